// Lowercase hex: how secrets and UCX worker addresses travel through the store.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mooncake {

std::string to_hex(const void* data, size_t n);

// The bytes `hex` spells, or nothing when it is not an even number of
// lowercase hex digits.
std::optional<std::vector<uint8_t>> from_hex(std::string_view hex);

}  // namespace mooncake
