// Element types and reduction ops: sizes, names, and which op is defined on
// which type (AVG on floating types only, bitwise ops on integers and bool).
#include "core/dtype.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

namespace mctest {
namespace {

using mooncake::DType;
using mooncake::RedOp;

TEST(DType, SizesMatchTheCTypes) {
  EXPECT_EQ(mooncake::dtype_size(DType::kBool), sizeof(bool));
  EXPECT_EQ(mooncake::dtype_size(DType::kUInt8), 1u);
  EXPECT_EQ(mooncake::dtype_size(DType::kInt8), 1u);
  EXPECT_EQ(mooncake::dtype_size(DType::kInt16), 2u);
  EXPECT_EQ(mooncake::dtype_size(DType::kUInt16), 2u);
  EXPECT_EQ(mooncake::dtype_size(DType::kFloat16), 2u);
  EXPECT_EQ(mooncake::dtype_size(DType::kBFloat16), 2u);
  EXPECT_EQ(mooncake::dtype_size(DType::kInt32), 4u);
  EXPECT_EQ(mooncake::dtype_size(DType::kUInt32), 4u);
  EXPECT_EQ(mooncake::dtype_size(DType::kFloat32), 4u);
  EXPECT_EQ(mooncake::dtype_size(DType::kInt64), 8u);
  EXPECT_EQ(mooncake::dtype_size(DType::kUInt64), 8u);
  EXPECT_EQ(mooncake::dtype_size(DType::kFloat64), 8u);
  EXPECT_EQ(mooncake::dtype_size(DType::kCount), 0u);
}

TEST(DType, NamesAreDistinctAndOutOfRangeIsUnknown) {
  std::set<std::string> names;
  for (int t = 0; t < static_cast<int>(DType::kCount); ++t)
    names.insert(mooncake::dtype_name(static_cast<DType>(t)));
  EXPECT_EQ(names.size(), static_cast<size_t>(DType::kCount));
  EXPECT_STREQ(mooncake::dtype_name(DType::kCount), "unknown");
  std::set<std::string> ops;
  for (int op = 0; op < static_cast<int>(RedOp::kCount); ++op)
    ops.insert(mooncake::redop_name(static_cast<RedOp>(op)));
  EXPECT_EQ(ops.size(), static_cast<size_t>(RedOp::kCount));
  EXPECT_STREQ(mooncake::redop_name(RedOp::kCount), "unknown");
}

TEST(DType, ExactlyTheFourFloatTypesAreFloating) {
  std::set<DType> floating = {DType::kFloat16, DType::kBFloat16, DType::kFloat32, DType::kFloat64};
  for (int t = 0; t < static_cast<int>(DType::kCount); ++t)
    EXPECT_EQ(mooncake::dtype_is_floating(static_cast<DType>(t)),
              floating.count(static_cast<DType>(t)) == 1)
        << mooncake::dtype_name(static_cast<DType>(t));
}

TEST(DType, AvgNeedsAFloatTypeAndBitwiseOpsNeedAnIntegerOrBool) {
  for (int ti = 0; ti < static_cast<int>(DType::kCount); ++ti) {
    const DType t = static_cast<DType>(ti);
    const bool floating = mooncake::dtype_is_floating(t);
    for (RedOp op : {RedOp::kSum, RedOp::kProduct, RedOp::kMin, RedOp::kMax})
      EXPECT_TRUE(mooncake::redop_supported(op, t)) << mooncake::dtype_name(t);
    EXPECT_EQ(mooncake::redop_supported(RedOp::kAvg, t), floating) << mooncake::dtype_name(t);
    for (RedOp op : {RedOp::kBand, RedOp::kBor, RedOp::kBxor})
      EXPECT_EQ(mooncake::redop_supported(op, t), !floating)
          << mooncake::redop_name(op) << " " << mooncake::dtype_name(t);
    EXPECT_FALSE(mooncake::redop_supported(RedOp::kCount, t));
  }
  EXPECT_FALSE(mooncake::redop_supported(RedOp::kSum, DType::kCount));
}

}  // namespace
}  // namespace mctest
