#include "torch/tensor_args.h"

#include "core/error.h"

namespace mooncake {

std::string dtype_str(at::ScalarType t) {
  return "torch." + std::string(c10::getDtypeNames(t).first);
}

DType to_dtype(at::ScalarType t, const char* op, const char* arg) {
  switch (t) {
    case at::kBool: return DType::kBool;
    case at::kByte: return DType::kUInt8;
    case at::kChar: return DType::kInt8;
    case at::kShort: return DType::kInt16;
    case at::kInt: return DType::kInt32;
    case at::kLong: return DType::kInt64;
    case at::kUInt16: return DType::kUInt16;
    case at::kUInt32: return DType::kUInt32;
    case at::kUInt64: return DType::kUInt64;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    case at::kComplexFloat: return DType::kFloat32;  // moved as pairs of floats
    case at::kComplexDouble: return DType::kFloat64;
    default:
      throw_error(ErrorKind::kInvalidArgument, -1, op, ": ", arg, " has dtype ", dtype_str(t),
                  ", which mooncake does not support");
  }
}

RedOp to_redop(const c10d::ReduceOp& op, const at::Tensor& t, const char* name) {
  RedOp r;
  switch (op.op_) {
    case c10d::ReduceOp::SUM: r = RedOp::kSum; break;
    case c10d::ReduceOp::AVG: r = RedOp::kAvg; break;
    case c10d::ReduceOp::PRODUCT: r = RedOp::kProduct; break;
    case c10d::ReduceOp::MIN: r = RedOp::kMin; break;
    case c10d::ReduceOp::MAX: r = RedOp::kMax; break;
    case c10d::ReduceOp::BAND: r = RedOp::kBand; break;
    case c10d::ReduceOp::BOR: r = RedOp::kBor; break;
    case c10d::ReduceOp::BXOR: r = RedOp::kBxor; break;
    default:
      throw_error(ErrorKind::kInvalidArgument, -1, name,
                  ": op must be SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR or BXOR; PREMUL_SUM is "
                  "not supported");
  }
  MC_CHECK_ARG(!t.is_complex() || r == RedOp::kSum || r == RedOp::kAvg, name,
               ": complex tensors support only SUM and AVG");
  DType dt = to_dtype(t.scalar_type(), name, "tensor");
  MC_CHECK_ARG(redop_supported(r, dt), name, ": op ", redop_name(r), " is not defined for dtype ",
               dtype_str(t.scalar_type()),
               r == RedOp::kAvg ? " (AVG needs a floating-point tensor)"
                                : " (bitwise ops need an integer or bool tensor)");
  return r;
}

void check_count(size_t got, size_t want, const char* name, const char* what) {
  MC_CHECK_ARG(got == want, name, ": ", what, " must have ", want, " entries, got ", got);
}

void check_tensor(const at::Tensor& t, const char* op, const char* arg) {
  MC_CHECK_ARG(t.defined(), op, ": ", arg, " is undefined");
  MC_CHECK_ARG(t.layout() == at::kStrided, op, ": ", arg, " must be a dense (strided) tensor");
  MC_CHECK_ARG(t.device().is_cpu(), op, ": ", arg,
               " must be a CPU tensor for backend mooncake-cpu, got ", t.device().str());
  to_dtype(t.scalar_type(), op, arg);
}

void check_rank(int64_t rank, int world_size, const char* op, const char* arg, bool allow_any) {
  MC_CHECK_ARG((rank >= 0 && rank < world_size) || (allow_any && rank == -1), op, ": ", arg,
               " must be in [0, ", world_size, ")", allow_any ? " or any source" : "", ", got ",
               rank);
}

void check_list(const std::vector<at::Tensor>& list, int world_size, const at::Tensor& like,
                const char* op, const char* arg, const char* like_name) {
  check_count(list.size(), static_cast<size_t>(world_size), op, arg);
  for (const auto& t : list) {
    check_tensor(t, op, arg);
    MC_CHECK_ARG(t.numel() == like.numel() && t.scalar_type() == like.scalar_type(), op,
                 ": every tensor in ", arg, " must match the ", like_name, " (", like.numel(),
                 " elements of ", dtype_str(like.scalar_type()), "), got ", t.numel(),
                 " elements of ", dtype_str(t.scalar_type()));
  }
}

std::vector<size_t> split_counts(const at::Tensor& t, const std::vector<int64_t>& given,
                                 int world_size, const char* arg, const char* tensor) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  std::vector<size_t> counts(static_cast<size_t>(world_size));
  const size_t row = rows == 0 ? 0 : elems(t) / static_cast<size_t>(rows);
  if (given.empty()) {
    MC_CHECK_ARG(rows % world_size == 0, "all_to_all_single: ", tensor, " dim 0 (", rows,
                 ") must be divisible by the world size (", world_size, ") when ", arg,
                 " is not given");
    for (auto& c : counts) c = static_cast<size_t>(rows / world_size) * row;
    return counts;
  }
  check_count(given.size(), static_cast<size_t>(world_size), "all_to_all_single", arg);
  int64_t total = 0;
  for (int p = 0; p < world_size; ++p) {
    MC_CHECK_ARG(given[p] >= 0, "all_to_all_single: ", arg, " must be >= 0, got ", given[p]);
    counts[p] = static_cast<size_t>(given[p]) * row;
    total += given[p];
  }
  MC_CHECK_ARG(total == rows, "all_to_all_single: ", arg, " sum to ", total, " but ", tensor,
               " dim 0 has ", rows, " rows");
  return counts;
}

}  // namespace mooncake
