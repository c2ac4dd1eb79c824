// Strict reading of the small text records that ranks leave in the store
// (peer addresses, group views, agreement reports, elastic EP metadata). The
// store is shared by every member, so a record can be truncated, stale, or
// written by a buggy or hostile member: every field is read whole, checked
// against its range, and anything left over is an error. A record that fails
// throws an Error of kind kInternal naming the record and the field.
#pragma once

#include <charconv>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

#include "core/error.h"

namespace mooncake {

class RecordReader {
 public:
  // `what` names the record in errors, e.g. "the group view under 'g/admitted/3/1'".
  // The reader keeps its own copy of `text` (records are small), so it may be
  // made from a temporary such as the result of Store::get.
  RecordReader(std::string text, std::string what)
      : text_(std::move(text)), what_(std::move(what)) {}

  // The next field as an integer in [lo, hi]: decimal digits, with a leading
  // '-' only where lo < 0.
  template <typename T>
  T number(const char* field, T lo = std::numeric_limits<T>::min(),
           T hi = std::numeric_limits<T>::max()) {
    static_assert(std::is_integral_v<T>);
    const std::string_view f = next(field);
    T v{};
    const auto [end, ec] = std::from_chars(f.data(), f.data() + f.size(), v);
    if (ec != std::errc() || end != f.data() + f.size() || (f[0] == '-' && lo >= 0))
      fail(field, lo < 0 ? " is not an" : " is not a non-negative", " integer: '", f, "'");
    if (v < lo || v > hi)
      fail(field, " is ", +v, ", outside [", +lo, ", ", +hi,
           "]");  // + prints char types as numbers
    return v;
  }

  // The next field as text of 1 to max_len bytes.
  std::string word(const char* field, size_t max_len) {
    const std::string_view f = next(field);
    if (f.size() > max_len) fail(field, " is longer than ", max_len, " bytes");
    return std::string(f);
  }

  // Nothing but one final separator may follow.
  void end() {
    if (pos_ < text_.size() && !(pos_ + 1 == text_.size() && is_sep(text_[pos_])))
      fail("the record", " has ", text_.size() - pos_, " unexpected bytes at its end");
  }

  // Whether another field follows.
  bool more() const {
    return pos_ < text_.size() && !(pos_ + 1 == text_.size() && is_sep(text_[pos_]));
  }

  template <typename... Args>
  [[noreturn]] void fail(const char* field, const Args&... args) const {
    throw_error(ErrorKind::kInternal, -1, "malformed ", what_, " in the store: ", field, args...);
  }

 private:
  static bool is_sep(char c) { return c == ' ' || c == '\n'; }

  // Fields are separated by exactly one space or newline.
  std::string_view next(const char* field) {
    if (pos_ > 0) {
      if (pos_ >= text_.size() || !is_sep(text_[pos_])) fail(field, " is missing");
      ++pos_;
    }
    size_t stop = pos_;
    while (stop < text_.size() && !is_sep(text_[stop])) ++stop;
    if (stop == pos_) fail(field, " is missing");
    const std::string_view f = std::string_view(text_).substr(pos_, stop - pos_);
    pos_ = stop;
    return f;
  }

  std::string text_;
  std::string what_;
  size_t pos_ = 0;
};

}  // namespace mooncake
