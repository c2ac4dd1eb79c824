// From torch's arguments to the core's: dtype and reduce-op conversion,
// element counts, contiguous output buffers, and the argument checks of the
// mooncake-cpu backend. Each check raises a ValueError (kInvalidArgument)
// naming the op and the argument, as Python users know them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <vector>

#include "core/dtype.h"

namespace mooncake {

// "torch.int8", as Python users know the dtype.
std::string dtype_str(at::ScalarType t);

// The core dtype of `t`'s elements (complex as pairs of floats), or a
// ValueError naming `op` and `arg`.
DType to_dtype(at::ScalarType t, const char* op, const char* arg);

// Elements of the core dtype a tensor holds (complex counts twice).
inline size_t elems(const at::Tensor& t) {
  return static_cast<size_t>(t.numel()) * (t.is_complex() ? 2 : 1);
}

// The core's reduce op for `op` over `t`, checked against `t`'s dtype.
RedOp to_redop(const c10d::ReduceOp& op, const at::Tensor& t, const char* name);

// A contiguous tensor to write results into, and how to copy them back.
struct OutBuf {
  at::Tensor user, buf;
  explicit OutBuf(const at::Tensor& t) : user(t), buf(t.is_contiguous() ? t : t.contiguous()) {}
  void* ptr() const { return buf.data_ptr(); }
  void commit() const {
    if (!buf.is_same(user)) user.copy_(buf);
  }
};

void check_count(size_t got, size_t want, const char* name, const char* what);
// A defined, dense CPU tensor of a dtype mooncake supports.
void check_tensor(const at::Tensor& t, const char* op, const char* arg);
// `rank` names a rank of a group of `world_size` (or, with allow_any, -1: any source).
void check_rank(int64_t rank, int world_size, const char* op, const char* arg,
                bool allow_any = false);
// all_to_all_single's split of `t` along dim 0 (rows of the remaining dims):
// the elements (as elems() counts them) for each of the `world_size` ranks,
// from `given` (row counts; empty: equal parts). `arg` and `tensor` name them.
std::vector<size_t> split_counts(const at::Tensor& t, const std::vector<int64_t>& given,
                                 int world_size, const char* arg, const char* tensor);
// `list` holds world-size tensors, each with the size and dtype of `like`.
void check_list(const std::vector<at::Tensor>& list, int world_size, const at::Tensor& like,
                const char* op, const char* arg, const char* like_name);

}  // namespace mooncake
