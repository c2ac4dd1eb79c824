// The device-driven collectives (DeviceCollectives::direct, device/direct_ops.h,
// kernels/coll/direct.h) among processes on the GPU. all_reduce: one-shot and
// two-shot against the host's reduce_arrays and the host-driven plane, bit for
// bit, over dtypes, ops, sizes and misaligned pointers. Every other kind
// (reduce, broadcast, all_gather, gather, reduce_scatter, scatter, all_to_all)
// the same way, for every root, with odd counts, misaligned inputs and outputs,
// overlapping buffers and empty ops. All of them at worlds 1-3. Launches
// captured in a CUDA graph (one op, and a sequence of mixed kinds) and replayed
// with new inputs, eager launches in between; calls that disagree on the kind,
// root, count, dtype or op; and a rank that dies between launches: the
// survivors mask it at once (zeros in its parts), and set the path up again
// without it once the host has agreed on the new view. The shape words and the
// parts of each kind need no GPU; every other test does (gpu.h).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "collectives/reduce.h"
#include "device/collectives.h"
#include "device/cuda.h"
#include "gpu.h"
#include "kernels/coll/direct.h"

namespace mctest {
namespace {

using mooncake::DeviceArray;
using mooncake::DeviceCollectives;
using mooncake::DType;
using mooncake::RedOp;
using mooncake::kernels::DirectKind;
using Direct = DeviceCollectives::Direct;
using DirectOp = DeviceCollectives::DirectOp;
using Bytes = std::vector<uint8_t>;

DeviceCollectives::Options options(Direct direct, size_t segment_bytes = 1 << 20) {
  DeviceCollectives::Options o;
  o.segment_bytes = segment_bytes;
  o.direct = direct;
  return o;
}

// The store prefix of a test's DeviceCollectives of algorithm `algo`.
std::string prefix(const char* name, Direct algo) {
  std::string out = name;
  out += std::to_string(static_cast<int>(algo));
  out += '/';
  return out;
}

DirectOp make_op(DirectKind kind, const void* in, void* out, size_t count, DType dtype,
                 RedOp op = RedOp::kSum, int root = 0) {
  DirectOp d;
  d.kind = kind;
  d.in = in;
  d.out = out;
  d.count = count;
  d.dtype = dtype;
  d.op = op;
  d.root = root;
  return d;
}

// The device-driven all_reduce, as the tests of all_reduce alone call it.
void direct_all_reduce(DeviceCollectives& c, const void* in, void* out, size_t count, DType dtype,
                       RedOp op, cudaStream_t stream, int64_t timeout_ms = -1) {
  c.direct(make_op(DirectKind::kAllReduce, in, out, count, dtype, op), stream, timeout_ms);
}

const char* kind_name(DirectKind kind) {
  switch (kind) {
    case DirectKind::kAllReduce: return "all_reduce";
    case DirectKind::kReduce: return "reduce";
    case DirectKind::kBroadcast: return "broadcast";
    case DirectKind::kAllGather: return "all_gather";
    case DirectKind::kGather: return "gather";
    case DirectKind::kReduceScatter: return "reduce_scatter";
    case DirectKind::kScatter: return "scatter";
    case DirectKind::kAllToAll: return "all_to_all";
  }
  return "?";
}

const DirectKind kKinds[] = {
    DirectKind::kAllReduce, DirectKind::kReduce,   DirectKind::kBroadcast,
    DirectKind::kAllGather, DirectKind::kGather,   DirectKind::kReduceScatter,
    DirectKind::kScatter,   DirectKind::kAllToAll,
};

// Rank `rank`'s `n` elements of `dtype` for call `tag`: small values, signed
// where the type is, scaled by 0.37 for floating types (so sums round, and
// the order of the sources shows in the bits).
std::vector<uint8_t> input(DType dtype, size_t n, int rank, int tag) {
  const size_t esize = mooncake::dtype_size(dtype);
  std::vector<uint8_t> out(n * esize);
  for (size_t i = 0; i < n; ++i) {
    const int v = static_cast<int>((i * 7 + static_cast<size_t>(rank) * 13 + tag * 5) % 23) - 11;
    const float f = static_cast<float>(v) * 0.37f;
    uint8_t* e = out.data() + i * esize;
    auto put = [&](auto x) { std::memcpy(e, &x, sizeof(x)); };
    switch (dtype) {
      case DType::kBool: put(static_cast<uint8_t>(v & 1)); break;
      case DType::kUInt8: put(static_cast<uint8_t>(v)); break;
      case DType::kInt8: put(static_cast<int8_t>(v)); break;
      case DType::kInt16: put(static_cast<int16_t>(v)); break;
      case DType::kInt32: put(static_cast<int32_t>(v)); break;
      case DType::kInt64: put(static_cast<int64_t>(v)); break;
      case DType::kUInt16: put(static_cast<uint16_t>(v)); break;
      case DType::kUInt32: put(static_cast<uint32_t>(v)); break;
      case DType::kUInt64: put(static_cast<uint64_t>(v)); break;
      case DType::kFloat16: put(mooncake::float_to_half(f)); break;
      case DType::kBFloat16: put(mooncake::float_to_bf16(f)); break;
      case DType::kFloat32: put(f); break;
      case DType::kFloat64: put(static_cast<double>(f)); break;
      default: ADD_FAILURE() << "no input for dtype " << static_cast<int>(dtype);
    }
  }
  return out;
}

// The host's reduction of every rank's input for call `tag`, in rank order.
std::vector<uint8_t> reference(DType dtype, RedOp op, size_t n, int world, int tag) {
  std::vector<std::vector<uint8_t>> ins;
  std::vector<const void*> srcs;
  for (int p = 0; p < world; ++p) ins.push_back(input(dtype, n, p, tag));
  for (auto& v : ins) srcs.push_back(v.data());
  std::vector<uint8_t> out(n * mooncake::dtype_size(dtype));
  mooncake::reduce_arrays(dtype, op, out.data(), srcs.data(), world, n, world);
  return out;
}

// Rank `p`'s input to an op of `kind` for call `tag` (`root` where the kind
// has one): its direct_in_parts parts of `count` elements, one input() (none
// where it has none).
Bytes input_of(DirectKind kind, DType dtype, size_t count, int world, int p, int root, int tag) {
  return input(dtype, mooncake::kernels::direct_in_parts(kind, world, p == root) * count, p, tag);
}

// What rank `me`'s output of the op holds (empty where it has none) when the
// ranks whose `in_op` entry is 1 took part, each with input_of's input: a
// reduction over them in rank order (AVG divided by their number, the host's
// reduce_arrays), and zeros in the parts of the ranks out of it.
Bytes expected(DirectKind kind, DType dtype, RedOp op, size_t count, int world, int me, int root,
               int tag, const std::vector<int>& in_op) {
  namespace k = mooncake::kernels;
  const size_t part = count * mooncake::dtype_size(dtype);
  Bytes out(k::direct_out_parts(kind, world, me == root) * part, 0);
  if (out.empty()) return out;
  std::vector<Bytes> ins;
  for (int p = 0; p < world; ++p) ins.push_back(input_of(kind, dtype, count, world, p, root, tag));
  // Part `j` of rank p's input into `to`.
  auto put = [&](uint8_t* to, int p, size_t j) {
    std::memcpy(to, ins[static_cast<size_t>(p)].data() + j * part, part);
  };
  auto took_part = [&](int p) { return in_op[static_cast<size_t>(p)] != 0; };
  const auto mine = static_cast<size_t>(me);
  switch (kind) {
    case DirectKind::kAllReduce:
    case DirectKind::kReduce:
    case DirectKind::kReduceScatter: {
      // Reduce-scatter reduces part `me` of every input; the others, the one part.
      const size_t at = kind == DirectKind::kReduceScatter ? mine * part : 0;
      std::vector<const void*> srcs;
      for (int p = 0; p < world; ++p)
        if (took_part(p)) srcs.push_back(ins[static_cast<size_t>(p)].data() + at);
      const int n = static_cast<int>(srcs.size());
      if (n > 0) mooncake::reduce_arrays(dtype, op, out.data(), srcs.data(), n, count, n);
      break;
    }
    case DirectKind::kBroadcast:
      if (took_part(root)) put(out.data(), root, 0);
      break;
    case DirectKind::kScatter:
      if (took_part(root)) put(out.data(), root, mine);
      break;
    case DirectKind::kAllGather:
    case DirectKind::kGather:
      for (int p = 0; p < world; ++p)
        if (took_part(p)) put(out.data() + static_cast<size_t>(p) * part, p, 0);
      break;
    case DirectKind::kAllToAll:
      for (int p = 0; p < world; ++p)
        if (took_part(p)) put(out.data() + static_cast<size_t>(p) * part, p, mine);
      break;
  }
  return out;
}

std::vector<int> everyone(int world) {
  return std::vector<int>(static_cast<size_t>(world), 1);
}

std::vector<uint8_t> read(const void* p, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  if (bytes == 0) return out;
  mooncake::cuda_check(cudaMemcpy(out.data(), p, bytes, cudaMemcpyDeviceToHost), "read back");
  return out;
}

void write(void* p, const std::vector<uint8_t>& bytes) {
  if (bytes.empty()) return;
  mooncake::cuda_check(cudaMemcpy(p, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), "write");
}

void fill(void* p, int byte, size_t bytes) {
  mooncake::cuda_check(cudaMemset(p, byte, bytes), "fill");
}

void sync(cudaStream_t stream) {
  mooncake::cuda_check(cudaStreamSynchronize(stream), "sync");
}

// The same op on the host-driven plane, `in` read and the result written to
// `out` (laid out as the op's): what DeviceCollectives::direct falls back to.
// False where the plane writes nothing there (a broadcast's root).
bool on_plane(DeviceCollectives& c, const DirectOp& op, const void* in, void* out, int world,
              int rank, cudaStream_t stream) {
  const size_t part = op.count * mooncake::dtype_size(op.dtype);
  std::vector<const void*> ins;
  std::vector<void*> outs;
  for (int p = 0; p < world; ++p) {
    const size_t at = static_cast<size_t>(p) * part;
    ins.push_back(in == nullptr ? nullptr : static_cast<const uint8_t*>(in) + at);
    outs.push_back(out == nullptr ? nullptr : static_cast<uint8_t*>(out) + at);
  }
  const bool root = rank == op.root;
  switch (op.kind) {
    case DirectKind::kAllReduce:
      c.all_reduce(in, out, op.count, op.dtype, op.op, stream);
      return true;
    case DirectKind::kReduce:
      c.reduce(in, out, op.count, op.dtype, op.op, op.root, stream);
      return root;
    case DirectKind::kBroadcast:
      c.broadcast(in, out, op.count, op.dtype, op.root, stream);
      return !root;
    case DirectKind::kAllGather:
      c.all_gather(in, op.count, op.dtype, outs.data(), stream);
      return true;
    case DirectKind::kGather:
      c.gather(in, op.count, op.dtype, root ? outs.data() : nullptr, op.root, stream);
      return root;
    case DirectKind::kReduceScatter:
      c.reduce_scatter(ins.data(), out, op.count, op.dtype, op.op, stream);
      return true;
    case DirectKind::kScatter:
      c.scatter(root ? ins.data() : nullptr, out, op.count, op.dtype, op.root, stream);
      return true;
    case DirectKind::kAllToAll: {
      const std::vector<size_t> counts(static_cast<size_t>(world), op.count);
      c.all_to_all(ins.data(), counts.data(), outs.data(), counts.data(), op.dtype, stream);
      return true;
    }
  }
  return false;
}

struct Sweep {
  DType dtype;
  RedOp op;
};
// Every element type once, through every op kind (AVG and the fp32
// accumulation of the 16-bit floats; wrapping integer products; bitwise).
const Sweep kSweep[] = {
    {DType::kFloat32, RedOp::kSum}, {DType::kBFloat16, RedOp::kAvg},
    {DType::kFloat16, RedOp::kMin}, {DType::kFloat64, RedOp::kProduct},
    {DType::kInt64, RedOp::kMax},   {DType::kInt32, RedOp::kProduct},
    {DType::kInt16, RedOp::kSum},   {DType::kInt8, RedOp::kBxor},
    {DType::kUInt8, RedOp::kBor},   {DType::kUInt16, RedOp::kMin},
    {DType::kUInt32, RedOp::kBand}, {DType::kUInt64, RedOp::kSum},
    {DType::kBool, RedOp::kMax},
};
// The kinds beside all_reduce: the moves per element size (1: int8, an odd
// size; 2: bf16, a 2-byte float; 4; 8), the reductions through a few ops.
const std::vector<Sweep> kMoveSweep = {
    {DType::kInt8, RedOp::kSum},
    {DType::kBFloat16, RedOp::kSum},
    {DType::kFloat32, RedOp::kSum},
    {DType::kFloat64, RedOp::kSum},
};
const std::vector<Sweep> kReduceSweep = {
    {DType::kFloat32, RedOp::kSum},
    {DType::kBFloat16, RedOp::kAvg},
    {DType::kInt8, RedOp::kBxor},
    {DType::kFloat16, RedOp::kMax},
};

// No GPU needed: every two-shot share fits its slot, for any world and size
// up to the area's largest op, and starts on a 16-byte boundary.
TEST(DirectLayout, EveryShareFitsItsSlot) {
  for (size_t max : {size_t{1}, size_t{1000}, size_t{4096}, size_t{65536}, size_t{8} << 20}) {
    const auto l = mooncake::kernels::DirectLayout::of(max);
    EXPECT_EQ(l.input(1) - l.input(0), l.parity_bytes);
    EXPECT_EQ(l.exports, l.input(1) + l.parity_bytes);
    EXPECT_EQ(l.exports % 256, 0u);
    EXPECT_GE(l.total_bytes,
              l.exports + mooncake::kernels::kXSlots * mooncake::kernels::kXExportBytes);
    EXPECT_EQ(l.share(0) % 256, 0u);
    for (size_t esize : {size_t{1}, size_t{2}, size_t{4}, size_t{8}})
      for (int ranks : {2, 3, 4, 7, 8, 64})
        for (size_t count : {max / esize, max / esize - max / esize / 3, size_t{1}}) {
          if (count == 0) continue;
          const size_t per = mooncake::kernels::direct_share_elems(count, ranks, esize);
          EXPECT_EQ(per * esize % 16, 0u);
          EXPECT_GE(per * static_cast<size_t>(ranks), count);
          EXPECT_LE(per * esize, l.share_bytes) << max << " " << esize << " " << ranks;
        }
  }
}

// No GPU needed: the control block's words, each parity's apart, fit before
// the first parity and overlap nowhere.
TEST(DirectLayout, ControlWordsApart) {
  using L = mooncake::kernels::DirectLayout;
  std::set<size_t> words;
  for (uint64_t seq : {0, 1}) {
    words.insert(L::shape(seq));
    words.insert(L::offer(seq));
    words.insert(L::offer(seq) + 8);
    words.insert(L::mapped_ok(seq));
  }
  words.insert(L::kInputSignal);
  words.insert(L::kShareSignal);
  words.insert(L::kMappedSignal);
  words.insert(L::kMappedCopied);
  words.insert(L::kMappedDone);
  EXPECT_EQ(words.size(), 13u);
  for (size_t w : words) {
    EXPECT_EQ(w % 8, 0u);
    EXPECT_LE(w + 8, L::kAlign);
  }
}

// A mapped op's per-op fence keeps its rank out of the op it names (and of
// any later one it names), never of the next ones: the rank publishes over
// an earlier op's fence; a fence of an older generation is void.
TEST(DirectLayout, PerOpFencesKeepOutTheirOpOnly) {
  using mooncake::kernels::direct_fence;
  using mooncake::kernels::direct_tag;
  using mooncake::kernels::tag_fenced_from;
  using mooncake::kernels::tag_settled;
  const uint32_t gen = 7;
  for (uint64_t seq : {uint64_t{1}, uint64_t{41}, uint64_t{0xffffffff}}) {
    EXPECT_TRUE(tag_fenced_from(direct_fence(gen, seq), gen, seq));
    EXPECT_FALSE(tag_settled(direct_fence(gen, seq), gen, seq));
    // An earlier op's fence: the next op's signal goes over it.
    EXPECT_FALSE(tag_fenced_from(direct_fence(gen, seq), gen, seq + 1));
    EXPECT_FALSE(tag_fenced_from(direct_fence(gen, seq), gen, seq + 1000));
    // A later op's fence stands for this op's signal, which came.
    EXPECT_TRUE(tag_settled(direct_fence(gen, seq + 1), gen, seq));
    // Not a fence, or another generation's.
    EXPECT_FALSE(tag_fenced_from(direct_tag(gen, seq), gen, seq));
    EXPECT_FALSE(tag_fenced_from(direct_fence(gen - 1, seq), gen, seq));
  }
}

// A wait settles on this op or a later one of its generation, or on a newer
// generation; never on an older generation or an earlier op (zeroed memory).
TEST(DirectLayout, SignalsSettleOnlyOnThisOpOrLater) {
  using mooncake::kernels::direct_tag;
  using mooncake::kernels::tag_ahead;
  using mooncake::kernels::tag_settled;
  EXPECT_FALSE(tag_settled(0, 1, 1));
  EXPECT_FALSE(tag_settled(direct_tag(1, 4), 1, 5));
  EXPECT_TRUE(tag_settled(direct_tag(1, 5), 1, 5));
  EXPECT_TRUE(tag_settled(direct_tag(1, 6), 1, 5));
  EXPECT_EQ(tag_ahead(direct_tag(1, 6), 5), 1u);
  EXPECT_FALSE(tag_settled(direct_tag(3, 9), 4, 1));
  EXPECT_TRUE(tag_settled(direct_tag(5, 1), 4, 9));
  // Past 2^32 ops the numbers wrap, and still compare.
  EXPECT_TRUE(tag_settled(direct_tag(1, (uint64_t{1} << 32) + 2), 1, (uint64_t{1} << 32) - 1));
  EXPECT_FALSE(tag_settled(direct_tag(1, (uint64_t{1} << 32) - 1), 1, (uint64_t{1} << 32) + 2));
}

// A fence set at op 7 stands for the signal of op 6 it replaced: ops up to 6
// took the peer, 7 and later of its generation do not; an older generation's
// fence is void (a wait goes on), a newer one's is the others moving on.
TEST(DirectLayout, AFenceKeepsItsRankOutFromItsOpOn) {
  using mooncake::kernels::direct_fence;
  using mooncake::kernels::direct_tag;
  using mooncake::kernels::tag_ahead;
  using mooncake::kernels::tag_fenced;
  using mooncake::kernels::tag_gen;
  using mooncake::kernels::tag_settled;
  const uint64_t f = direct_fence(3, 7);
  EXPECT_EQ(tag_gen(f), 3u);
  EXPECT_TRUE(tag_settled(f, 3, 6));
  EXPECT_EQ(tag_ahead(f, 6), 0u);
  EXPECT_FALSE(tag_fenced(f, 3, 6));
  EXPECT_TRUE(tag_settled(f, 3, 5));  // op 5: one ahead, as op 6's signal is
  EXPECT_FALSE(tag_settled(f, 3, 7));
  EXPECT_TRUE(tag_fenced(f, 3, 7));
  EXPECT_TRUE(tag_fenced(f, 3, 9));
  EXPECT_FALSE(tag_settled(f, 4, 1));  // older: void, not settled...
  EXPECT_FALSE(tag_fenced(f, 4, 1));   // ...nor fencing
  EXPECT_TRUE(tag_settled(f, 2, 9));   // newer: settled, and reported as such
  EXPECT_FALSE(tag_fenced(direct_tag(3, 7), 3, 7));
  // At op 1 a fence stands for op 0's signal, which no op waits for.
  EXPECT_TRUE(tag_fenced(direct_fence(3, 1), 3, 1));
}

// No GPU needed: ops that differ in any of kind, root, count, dtype and op
// have different shape words (so that the ranks of a launch find out), and
// none is the rejection's.
TEST(DirectLayout, ShapeWordsDifferInEveryField) {
  using mooncake::kernels::direct_shape;
  std::set<uint64_t> seen;
  size_t combos = 0;
  const size_t counts[] = {
      0, 1, 2, 7, 4099, size_t{1} << 20, size_t{1} << 35, mooncake::kernels::kDirectMaxCount - 1};
  const DType dtypes[] = {DType::kBool,     DType::kInt8,    DType::kUInt8,  DType::kFloat16,
                          DType::kBFloat16, DType::kFloat32, DType::kFloat64};
  const RedOp ops[] = {RedOp::kSum, RedOp::kMax, RedOp::kAvg, RedOp::kBxor};
  for (DirectKind kind : kKinds)
    for (int root : {0, 1, 2, mooncake::kernels::kDirectMaxRanks - 1})
      for (size_t count : counts)
        for (DType dtype : dtypes)
          for (RedOp op : ops) {
            const uint64_t shape = direct_shape(kind, root, count, dtype, op);
            EXPECT_NE(shape, mooncake::kernels::kShapeRejected);
            EXPECT_EQ(shape, direct_shape(kind, root, count, dtype, op));
            seen.insert(shape);
            ++combos;
          }
  EXPECT_EQ(seen.size(), combos);
  // Each field alone.
  const uint64_t base = direct_shape(DirectKind::kAllGather, 1, 1000, DType::kFloat32, RedOp::kSum);
  EXPECT_NE(base, direct_shape(DirectKind::kAllToAll, 1, 1000, DType::kFloat32, RedOp::kSum));
  EXPECT_NE(base, direct_shape(DirectKind::kAllGather, 0, 1000, DType::kFloat32, RedOp::kSum));
  EXPECT_NE(base, direct_shape(DirectKind::kAllGather, 1, 1001, DType::kFloat32, RedOp::kSum));
  EXPECT_NE(base, direct_shape(DirectKind::kAllGather, 1, 1000, DType::kInt32, RedOp::kSum));
  EXPECT_NE(base, direct_shape(DirectKind::kAllGather, 1, 1000, DType::kFloat32, RedOp::kMax));
  // all_reduce's algorithm: ranks that chose differently leave each other out.
  EXPECT_NE(direct_shape(DirectKind::kAllReduce, 0, 1000, DType::kFloat32, RedOp::kSum, false),
            direct_shape(DirectKind::kAllReduce, 0, 1000, DType::kFloat32, RedOp::kSum, true));
  // Read in place or not: the same.
  const uint64_t mapped =
      direct_shape(DirectKind::kAllReduce, 0, 1000, DType::kFloat32, RedOp::kSum, false, true);
  EXPECT_NE(mapped,
            direct_shape(DirectKind::kAllReduce, 0, 1000, DType::kFloat32, RedOp::kSum, false));
  EXPECT_NE(mapped,
            direct_shape(DirectKind::kAllReduce, 0, 1000, DType::kFloat32, RedOp::kSum, true));
  // ...nor any other kind's word, at any root (the bit is a field of its own).
  for (DirectKind kind : kKinds)
    for (int root = 0; root < mooncake::kernels::kDirectMaxRanks; ++root)
      for (RedOp op : ops)
        for (bool two_shot : {false, true})
          EXPECT_NE(mapped, direct_shape(kind, root, 1000, DType::kFloat32, op, two_shot));
}

// No GPU needed: the parts of `count` elements in each kind's input and
// output, at the root and at the others, and which kinds reduce or have a root.
TEST(DirectLayout, PartsPerKindAndRole) {
  namespace k = mooncake::kernels;
  constexpr int kR = -1;  // R parts
  struct Row {
    DirectKind kind;
    bool reduces, rooted;
    int in_root, in_other, out_root, out_other;
  };
  const Row rows[] = {
      {DirectKind::kAllReduce, true, false, 1, 1, 1, 1},
      {DirectKind::kReduce, true, true, 1, 1, 1, 0},
      {DirectKind::kBroadcast, false, true, 1, 0, 1, 1},
      {DirectKind::kAllGather, false, false, 1, 1, kR, kR},
      {DirectKind::kGather, false, true, 1, 1, kR, 0},
      {DirectKind::kReduceScatter, true, false, kR, kR, 1, 1},
      {DirectKind::kScatter, false, true, kR, 0, 1, 1},
      {DirectKind::kAllToAll, false, false, kR, kR, kR, kR},
  };
  EXPECT_EQ(k::kDirectKinds, static_cast<int>(sizeof(rows) / sizeof(rows[0])));
  for (const Row& row : rows) {
    EXPECT_EQ(k::direct_reduces(row.kind), row.reduces) << kind_name(row.kind);
    EXPECT_EQ(k::direct_rooted(row.kind), row.rooted) << kind_name(row.kind);
    for (int ranks : {1, 2, 3, 8, k::kDirectMaxRanks}) {
      auto parts = [&](int n) { return static_cast<size_t>(n == kR ? ranks : n); };
      const std::string what = std::string(kind_name(row.kind)) + " R " + std::to_string(ranks);
      EXPECT_EQ(k::direct_in_parts(row.kind, ranks, true), parts(row.in_root)) << what;
      EXPECT_EQ(k::direct_in_parts(row.kind, ranks, false), parts(row.in_other)) << what;
      EXPECT_EQ(k::direct_out_parts(row.kind, ranks, true), parts(row.out_root)) << what;
      EXPECT_EQ(k::direct_out_parts(row.kind, ranks, false), parts(row.out_other)) << what;
    }
  }
}

class DirectAllReduceTest : public ::testing::TestWithParam<int> {};

TEST_P(DirectAllReduceTest, EqualsTheHostAndThePlaneBitForBit) {
  MC_REQUIRE_GPU();
  run_ranks(
      GetParam(),
      [](Rank& r) {
        GpuRank g(r);
        int tag = 0;
        for (Direct algo : {Direct::kOneShot, Direct::kTwoShot}) {
          DeviceCollectives c(g.comm, r.store, prefix("d", algo), g.device, options(algo));
          // 7: a tail only; 1001: vectors and a tail; 70000: several blocks (the
          // first sweeps only, for time).
          for (size_t n : {size_t{7}, size_t{1001}, size_t{70000}}) {
            for (const Sweep& s : kSweep) {
              if (n > 1001 && &s - kSweep >= 4) break;
              ++tag;
              const size_t bytes = n * mooncake::dtype_size(s.dtype);
              const std::vector<uint8_t> want = reference(s.dtype, s.op, n, r.size, tag);
              // The input one element past a 16-byte boundary, every other round:
              // the scalar paths.
              const size_t skew = (tag % 2) * mooncake::dtype_size(s.dtype);
              DeviceArray<uint8_t> in(bytes + 16), out(bytes + 16), plane(bytes);
              write(in.get() + skew, input(s.dtype, n, r.rank, tag));
              direct_all_reduce(c, in.get() + skew, out.get() + skew, n, s.dtype, s.op, g.stream);
              c.all_reduce(in.get() + skew, plane.get(), n, s.dtype, s.op, g.stream);
              sync(g.stream);
              const std::string what = "algo " + std::to_string(static_cast<int>(algo)) +
                                       " dtype " + std::to_string(static_cast<int>(s.dtype)) +
                                       " op " + std::to_string(static_cast<int>(s.op)) + " n " +
                                       std::to_string(n) + " skew " + std::to_string(skew);
              ASSERT_EQ(read(out.get() + skew, bytes), want) << what;
              ASSERT_EQ(read(plane.get(), bytes), want) << what;
            }
          }
          // In place, and nothing masked or reported on the way.
          const size_t n = 5000;
          ++tag;
          DeviceArray<uint8_t> x(n * 4);
          write(x.get(), input(DType::kFloat32, n, r.rank, tag));
          direct_all_reduce(c, x.get(), x.get(), n, DType::kFloat32, RedOp::kSum, g.stream);
          EXPECT_EQ(read(x.get(), n * 4), reference(DType::kFloat32, RedOp::kSum, n, r.size, tag));
          EXPECT_TRUE(c.direct_ready());
        }
      },
      {120000});
}

// A launch captured in a graph reads its state from device memory: replays
// take new inputs, and eager launches in between keep the ranks' numbering
// in step.
TEST_P(DirectAllReduceTest, CapturedAndReplayedEqualsEager) {
  MC_REQUIRE_GPU();
  run_ranks(
      GetParam(),
      [](Rank& r) {
        GpuRank g(r);
        for (Direct algo : {Direct::kOneShot, Direct::kTwoShot}) {
          DeviceCollectives c(g.comm, r.store, prefix("g", algo), g.device, options(algo));
          const size_t n = algo == Direct::kOneShot ? 1024 : 100000;  // 4 KiB; 400 KB
          const size_t bytes = n * 4;
          DeviceArray<uint8_t> in(bytes), out(bytes), eager(bytes);
          write(in.get(), input(DType::kFloat32, n, r.rank, 0));
          // The first call sets the path up (a host op): never under capture.
          EXPECT_FALSE(c.direct_ready());
          direct_all_reduce(c, in.get(), out.get(), n, DType::kFloat32, RedOp::kSum, g.stream);
          ASSERT_TRUE(c.direct_ready());
          cudaGraph_t graph = nullptr;
          cudaGraphExec_t exec = nullptr;
          mooncake::cuda_check(cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeThreadLocal),
                               "begin capture");
          direct_all_reduce(c, in.get(), out.get(), n, DType::kFloat32, RedOp::kSum, g.stream);
          mooncake::cuda_check(cudaStreamEndCapture(g.stream, &graph), "end capture");
          mooncake::cuda_check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
          for (int k = 1; k <= 6; ++k) {
            write(in.get(), input(DType::kFloat32, n, r.rank, k));
            mooncake::cuda_check(cudaGraphLaunch(exec, g.stream), "replay");
            if (k % 3 == 0)  // an eager call between replays, on another buffer
              direct_all_reduce(c, in.get(), eager.get(), n, DType::kFloat32, RedOp::kSum,
                                g.stream);
            sync(g.stream);
            const auto want = reference(DType::kFloat32, RedOp::kSum, n, r.size, k);
            ASSERT_EQ(read(out.get(), bytes), want) << "replay " << k;
            if (k % 3 == 0) {
              ASSERT_EQ(read(eager.get(), bytes), want) << "eager " << k;
            }
          }
          cudaGraphExecDestroy(exec);
          cudaGraphDestroy(graph);
        }
      },
      {120000});
}

INSTANTIATE_TEST_SUITE_P(Worlds, DirectAllReduceTest, ::testing::Values(1, 2, 3));

// Bytes around every output and input: what an op must not write.
constexpr int kGuard = 0xa5;
constexpr size_t kGuardBytes = 16;

// One op of `kind` at this rank, for call `tag`: its input (input_of) at
// `in_skew` bytes past a 16-byte boundary, its output at `out_skew`, both
// guarded; the output against expected() over every rank, and against the
// host-driven plane where `plane` and the plane writes it; the input and the
// guards unchanged. Returns false (after a failure) so that a caller can stop.
bool check_op(DeviceCollectives& c, Rank& r, cudaStream_t stream, DirectKind kind, const Sweep& s,
              size_t count, int root, int tag, size_t in_skew, size_t out_skew, bool plane) {
  namespace k = mooncake::kernels;
  const size_t part = count * mooncake::dtype_size(s.dtype);
  const bool am_root = r.rank == root;
  const size_t in_bytes = k::direct_in_parts(kind, r.size, am_root) * part;
  const size_t out_bytes = k::direct_out_parts(kind, r.size, am_root) * part;
  const std::string what = std::string(kind_name(kind)) + " dtype " +
                           mooncake::dtype_name(s.dtype) + " op " + mooncake::redop_name(s.op) +
                           " count " + std::to_string(count) + " root " + std::to_string(root) +
                           " skews " + std::to_string(in_skew) + "/" + std::to_string(out_skew) +
                           " tag " + std::to_string(tag) + " at rank " + std::to_string(r.rank);
  const size_t in_total = in_bytes + in_skew + kGuardBytes;
  const size_t out_total = out_bytes + out_skew + kGuardBytes;
  DeviceArray<uint8_t> in(in_total), out(out_total), on(out_bytes);
  fill(in.get(), kGuard, in_total);
  fill(out.get(), kGuard, out_total);
  const Bytes mine = input_of(kind, s.dtype, count, r.size, r.rank, root, tag);
  EXPECT_EQ(mine.size(), in_bytes) << what;
  write(in.get() + in_skew, mine);
  const DirectOp op =
      make_op(kind, in_bytes > 0 ? in.get() + in_skew : nullptr,
              out_bytes > 0 ? out.get() + out_skew : nullptr, count, s.dtype, s.op, root);
  EXPECT_TRUE(c.direct_serves(op, 10000)) << what;
  c.direct(op, stream);
  const bool plane_writes =
      plane && on_plane(c, op, op.in, out_bytes > 0 ? on.get() : nullptr, r.size, r.rank, stream);
  sync(stream);
  const Bytes want =
      expected(kind, s.dtype, s.op, count, r.size, r.rank, root, tag, everyone(r.size));
  Bytes whole_out(out_total, static_cast<uint8_t>(kGuard));
  std::memcpy(whole_out.data() + out_skew, want.data(), want.size());
  EXPECT_EQ(read(out.get(), out_total), whole_out) << what;
  if (plane_writes) {
    EXPECT_EQ(read(on.get(), out_bytes), want) << "plane: " << what;
  }
  Bytes whole_in(in_total, static_cast<uint8_t>(kGuard));
  std::memcpy(whole_in.data() + in_skew, mine.data(), mine.size());
  EXPECT_EQ(read(in.get(), in_total), whole_in) << "input: " << what;
  return !::testing::Test::HasFailure();
}

class DirectOpsTest : public ::testing::TestWithParam<int> {};

// Every kind, every root of the rooted ones, through dtypes of every element
// size and a few reduce ops, odd counts, inputs and outputs off 16-byte
// boundaries (each alone and both): the host's result and the plane's, bit for
// bit. Then empty ops, overlapping inputs and outputs, and a root's broadcast
// in place.
TEST_P(DirectOpsTest, EveryKindEqualsTheHostAndThePlaneBitForBit) {
  MC_REQUIRE_GPU();
  run_ranks(
      GetParam(),
      [](Rank& r) {
        namespace k = mooncake::kernels;
        GpuRank g(r);
        DeviceCollectives c(g.comm, r.store, "e/", g.device, options(Direct::kAuto));
        int tag = 0;
        // 1: one element; 7: a tail only; 1000: vectors, and parts that are
        // not (int8, bf16); 1024: parts of whole vectors; 4099: 4096 + 3.
        const size_t counts[] = {1, 7, 1000, 1024, 4099};
        for (DirectKind kind : kKinds) {
          const bool reduces = k::direct_reduces(kind);
          const int roots = k::direct_rooted(kind) ? r.size : 1;
          for (int root = 0; root < roots; ++root) {
            // A kind without a root ignores the field: each rank passes its own.
            const int given = k::direct_rooted(kind) ? root : r.rank;
            for (const Sweep& s : reduces ? kReduceSweep : kMoveSweep) {
              const size_t esize = mooncake::dtype_size(s.dtype);
              for (size_t count : counts) {
                ++tag;
                // Aligned, the input one element off, the output, then both.
                const size_t in_skew = (tag % 2) * esize, out_skew = (tag / 2 % 2) * esize;
                if (!check_op(c, r, g.stream, kind, s, count, given, tag, in_skew, out_skew, true))
                  return;
              }
            }
            // Several blocks per launch (fp32 only, for time), both aligned.
            ++tag;
            if (!check_op(c, r, g.stream, kind, {DType::kFloat32, RedOp::kSum}, 40000, given, tag,
                          0, 0, true))
              return;
          }
        }
        // Empty ops (no pointers) keep the ranks in step.
        for (DirectKind kind : kKinds)
          c.direct(make_op(kind, nullptr, nullptr, 0, DType::kFloat32), g.stream);
        ++tag;
        if (!check_op(c, r, g.stream, DirectKind::kAllToAll, {DType::kFloat32, RedOp::kSum}, 33, 0,
                      tag, 0, 0, false))
          return;

        // Inputs and outputs that overlap: the inputs are read from the areas.
        const int me = r.rank, R = r.size;
        const auto Rs = static_cast<size_t>(R), ms = static_cast<size_t>(me);
        for (const Sweep& s :
             {Sweep{DType::kFloat32, RedOp::kSum}, Sweep{DType::kInt8, RedOp::kSum}}) {
          for (size_t count : {size_t{7}, size_t{1000}}) {
            const size_t part = count * mooncake::dtype_size(s.dtype);
            const std::string what =
                std::string(mooncake::dtype_name(s.dtype)) + " count " + std::to_string(count);
            DeviceArray<uint8_t> buf(Rs * part);
            // all_gather in place: this rank's input is its part of the output.
            ++tag;
            fill(buf.get(), kGuard, Rs * part);
            write(buf.get() + ms * part,
                  input_of(DirectKind::kAllGather, s.dtype, count, R, me, 0, tag));
            c.direct(
                make_op(DirectKind::kAllGather, buf.get() + ms * part, buf.get(), count, s.dtype),
                g.stream);
            EXPECT_EQ(read(buf.get(), Rs * part), expected(DirectKind::kAllGather, s.dtype, s.op,
                                                           count, R, me, 0, tag, everyone(R)))
                << "all_gather in place " << what;
            // all_to_all in place.
            ++tag;
            write(buf.get(), input_of(DirectKind::kAllToAll, s.dtype, count, R, me, 0, tag));
            c.direct(make_op(DirectKind::kAllToAll, buf.get(), buf.get(), count, s.dtype),
                     g.stream);
            EXPECT_EQ(read(buf.get(), Rs * part), expected(DirectKind::kAllToAll, s.dtype, s.op,
                                                           count, R, me, 0, tag, everyone(R)))
                << "all_to_all in place " << what;
            // reduce_scatter into this rank's part of its own input.
            ++tag;
            write(buf.get(), input_of(DirectKind::kReduceScatter, s.dtype, count, R, me, 0, tag));
            c.direct(make_op(DirectKind::kReduceScatter, buf.get(), buf.get() + ms * part, count,
                             s.dtype, s.op),
                     g.stream);
            EXPECT_EQ(read(buf.get() + ms * part, part),
                      expected(DirectKind::kReduceScatter, s.dtype, s.op, count, R, me, 0, tag,
                               everyone(R)))
                << "reduce_scatter in place " << what;
            // scatter: the root's output another part of its input; broadcast:
            // the root's input is its output.
            for (int root = 0; root < R; ++root) {
              const bool am_root = me == root;
              DeviceArray<uint8_t> other(part);
              ++tag;
              fill(other.get(), kGuard, part);
              if (am_root)
                write(buf.get(), input_of(DirectKind::kScatter, s.dtype, count, R, me, root, tag));
              uint8_t* out = am_root ? buf.get() + (ms + 1) % Rs * part : other.get();
              c.direct(make_op(DirectKind::kScatter, am_root ? buf.get() : nullptr, out, count,
                               s.dtype, s.op, root),
                       g.stream);
              EXPECT_EQ(read(out, part), expected(DirectKind::kScatter, s.dtype, s.op, count, R, me,
                                                  root, tag, everyone(R)))
                  << "scatter in place, root " << root << " " << what;
              ++tag;
              fill(other.get(), kGuard, part);
              if (am_root)
                write(other.get(),
                      input_of(DirectKind::kBroadcast, s.dtype, count, R, me, root, tag));
              c.direct(make_op(DirectKind::kBroadcast, am_root ? other.get() : nullptr, other.get(),
                               count, s.dtype, s.op, root),
                       g.stream);
              EXPECT_EQ(read(other.get(), part), expected(DirectKind::kBroadcast, s.dtype, s.op,
                                                          count, R, me, root, tag, everyone(R)))
                  << "broadcast in place, root " << root << " " << what;
            }
          }
        }
        EXPECT_TRUE(c.direct_ready());
      },
      {180000});
}

// The list forms as the torch backend passes them (kernels::DirectList): each
// part of the input (scatter at the root, reduce_scatter) or of the output
// (all_gather, gather at the root, all_to_all) at its own address, apart from
// the others, aligned or one element off (no vectors then), every root: the
// flat op's bits, nothing written past a part, no input written.
TEST_P(DirectOpsTest, PartsAtTheirOwnAddressesEqualTheFlatOp) {
  MC_REQUIRE_GPU();
  run_ranks(
      GetParam(),
      [](Rank& r) {
        namespace k = mooncake::kernels;
        GpuRank g(r);
        DeviceCollectives c(g.comm, r.store, "l/", g.device, options(Direct::kAuto));
        int tag = 0;
        const std::pair<DirectKind, k::DirectList> lists[] = {
            {DirectKind::kAllGather, k::DirectList::kOut},
            {DirectKind::kGather, k::DirectList::kOut},
            {DirectKind::kAllToAll, k::DirectList::kOut},
            {DirectKind::kScatter, k::DirectList::kIn},
            {DirectKind::kReduceScatter, k::DirectList::kIn},
        };
        for (const auto& [kind, list] : lists) {
          const int roots = k::direct_rooted(kind) ? r.size : 1;
          for (int root = 0; root < roots; ++root) {
            for (const Sweep& s :
                 {Sweep{DType::kFloat32, RedOp::kSum}, Sweep{DType::kBFloat16, RedOp::kMax}}) {
              for (size_t count : {size_t{7}, size_t{1024}, size_t{40000}}) {
                for (size_t skew : {size_t{0}, mooncake::dtype_size(s.dtype)}) {
                  ++tag;
                  const bool am_root = r.rank == root;
                  const size_t part = count * mooncake::dtype_size(s.dtype);
                  const bool in_list = list == k::DirectList::kIn;
                  const size_t n = in_list ? k::direct_in_parts(kind, r.size, am_root)
                                           : k::direct_out_parts(kind, r.size, am_root);
                  const size_t flat_in = k::direct_in_parts(kind, r.size, am_root) * part;
                  const size_t flat_out = k::direct_out_parts(kind, r.size, am_root) * part;
                  const std::string what =
                      std::string(kind_name(kind)) + " " + mooncake::dtype_name(s.dtype) +
                      " count " + std::to_string(count) + " root " + std::to_string(root) +
                      " skew " + std::to_string(skew) + " at rank " + std::to_string(r.rank);
                  // One allocation per part, a guard past each.
                  std::vector<std::unique_ptr<DeviceArray<uint8_t>>> parts;
                  for (size_t p = 0; p < n; ++p) {
                    parts.push_back(
                        std::make_unique<DeviceArray<uint8_t>>(part + skew + kGuardBytes));
                    fill(parts.back()->get(), kGuard, part + skew + kGuardBytes);
                  }
                  const Bytes mine = input_of(kind, s.dtype, count, r.size, r.rank, root, tag);
                  DeviceArray<uint8_t> flat(std::max<size_t>(flat_in, 1)),
                      out(std::max<size_t>(flat_out, 1));
                  DirectOp op = make_op(kind, nullptr, nullptr, count, s.dtype, s.op, root);
                  op.list = n > 0 ? list : k::DirectList::kNone;
                  for (size_t p = 0; p < n; ++p) op.parts.push_back(parts[p]->get() + skew);
                  if (in_list) {
                    for (size_t p = 0; p < n; ++p)
                      write(parts[p]->get() + skew,
                            Bytes(mine.begin() + static_cast<std::ptrdiff_t>(p * part),
                                  mine.begin() + static_cast<std::ptrdiff_t>((p + 1) * part)));
                    if (flat_out > 0) op.out = out.get();
                  } else if (flat_in > 0) {
                    write(flat.get(), mine);
                    op.in = flat.get();
                  }
                  c.direct(op, g.stream);
                  sync(g.stream);
                  const Bytes want = expected(kind, s.dtype, s.op, count, r.size, r.rank, root, tag,
                                              everyone(r.size));
                  Bytes got;
                  if (in_list) {
                    got = read(out.get(), flat_out);
                    for (size_t p = 0; p < n; ++p) {
                      Bytes whole(part + skew + kGuardBytes, static_cast<uint8_t>(kGuard));
                      std::memcpy(whole.data() + skew, mine.data() + p * part, part);
                      EXPECT_EQ(read(parts[p]->get(), whole.size()), whole)
                          << "input part " << p << " " << what;
                    }
                  } else {
                    for (size_t p = 0; p < n; ++p) {
                      const Bytes whole = read(parts[p]->get(), part + skew + kGuardBytes);
                      for (size_t b = 0; b < skew; ++b)
                        EXPECT_EQ(whole[b], kGuard) << "before part " << p << " " << what;
                      for (size_t b = skew + part; b < whole.size(); ++b)
                        EXPECT_EQ(whole[b], kGuard) << "past part " << p << " " << what;
                      got.insert(got.end(), whole.begin() + static_cast<std::ptrdiff_t>(skew),
                                 whole.begin() + static_cast<std::ptrdiff_t>(skew + part));
                    }
                  }
                  EXPECT_EQ(got, want) << what;
                  if (::testing::Test::HasFailure()) return;
                }
              }
            }
          }
        }
        EXPECT_TRUE(c.direct_ready());
      },
      {180000});
}

// An op as launches of pieces of every part (as the torch backend captures
// an op past the kernels' bound): each launch the same slice of each part,
// the stride the whole part. Every kind and root, parts of whole vectors
// (fp32, 1000) and not (1001; int8), a last piece shorter than the others:
// the whole op's bits, and nothing written past the output.
TEST_P(DirectOpsTest, PiecesOfEveryPartEqualTheWholeOp) {
  MC_REQUIRE_GPU();
  run_ranks(
      GetParam(),
      [](Rank& r) {
        namespace k = mooncake::kernels;
        GpuRank g(r);
        DeviceCollectives c(g.comm, r.store, "p/", g.device, options(Direct::kAuto));
        int tag = 0;
        constexpr size_t kPiece = 256;
        for (DirectKind kind : kKinds) {
          const int roots = k::direct_rooted(kind) ? r.size : 1;
          for (int root = 0; root < roots; ++root) {
            const int given = k::direct_rooted(kind) ? root : r.rank;
            const bool am_root = r.rank == given;
            for (const Sweep& s :
                 {Sweep{DType::kFloat32, RedOp::kSum}, Sweep{DType::kInt8, RedOp::kSum}}) {
              for (size_t count : {size_t{1000}, size_t{1001}}) {
                ++tag;
                const size_t esize = mooncake::dtype_size(s.dtype);
                const size_t part = count * esize;
                const size_t in_bytes = k::direct_in_parts(kind, r.size, am_root) * part;
                const size_t out_bytes = k::direct_out_parts(kind, r.size, am_root) * part;
                DeviceArray<uint8_t> in(in_bytes), out(out_bytes + kGuardBytes);
                fill(out.get(), kGuard, out_bytes + kGuardBytes);
                write(in.get(), input_of(kind, s.dtype, count, r.size, r.rank, given, tag));
                for (size_t first = 0; first < count; first += kPiece) {
                  DirectOp op = make_op(kind, in_bytes > 0 ? in.get() + first * esize : nullptr,
                                        out_bytes > 0 ? out.get() + first * esize : nullptr,
                                        std::min(kPiece, count - first), s.dtype, s.op, given);
                  op.stride = count;
                  c.direct(op, g.stream);
                }
                sync(g.stream);
                Bytes want = expected(kind, s.dtype, s.op, count, r.size, r.rank, given, tag,
                                      everyone(r.size));
                want.resize(want.size() + kGuardBytes, static_cast<uint8_t>(kGuard));
                ASSERT_EQ(read(out.get(), out_bytes + kGuardBytes), want)
                    << kind_name(kind) << " in pieces, dtype " << mooncake::dtype_name(s.dtype)
                    << " count " << count << " root " << given << " at rank " << r.rank;
              }
            }
          }
        }
        EXPECT_TRUE(c.direct_ready());
      },
      {180000});
}

// One op of a sequence: its kind, dtype, reduce op, count and root.
struct OpStep {
  DirectKind kind;
  DType dtype;
  RedOp op;
  size_t count;
  int root;
};

// Buffers of one step at this rank (null where it has no input or output).
struct StepBuffers {
  StepBuffers(const OpStep& s, int world, int rank) {
    namespace k = mooncake::kernels;
    const size_t part = s.count * mooncake::dtype_size(s.dtype);
    in_bytes = k::direct_in_parts(s.kind, world, rank == s.root) * part;
    out_bytes = k::direct_out_parts(s.kind, world, rank == s.root) * part;
    in = std::make_unique<DeviceArray<uint8_t>>(in_bytes);
    out = std::make_unique<DeviceArray<uint8_t>>(out_bytes);
    eager = std::make_unique<DeviceArray<uint8_t>>(out_bytes);
  }
  DirectOp op(const OpStep& s, bool to_eager) const {
    return make_op(s.kind, in_bytes > 0 ? in->get() : nullptr,
                   out_bytes == 0 ? nullptr
                   : to_eager     ? eager->get()
                                  : out->get(),
                   s.count, s.dtype, s.op, s.root);
  }
  size_t in_bytes = 0, out_bytes = 0;
  std::unique_ptr<DeviceArray<uint8_t>> in, out, eager;
};

// A graph that captures a sequence of every kind (all_reduce twice, two-shot
// where the options say so, among the moves), replayed twice with new inputs:
// each replay's results are the host's, and the same calls made eagerly
// after it give the same bits.
TEST_P(DirectOpsTest, MixedKindsCapturedAndReplayedEqualEager) {
  MC_REQUIRE_GPU();
  run_ranks(GetParam(),
            [](Rank& r) {
              GpuRank g(r);
              const int R = r.size, last = r.size - 1;
              const std::vector<OpStep> steps = {
                  {DirectKind::kAllGather, DType::kFloat32, RedOp::kSum, 1000, 0},
                  {DirectKind::kReduceScatter, DType::kBFloat16, RedOp::kSum, 513, 0},
                  {DirectKind::kAllReduce, DType::kFloat32, RedOp::kSum, 30000, 0},
                  {DirectKind::kBroadcast, DType::kInt8, RedOp::kSum, 77, last},
                  {DirectKind::kAllToAll, DType::kFloat64, RedOp::kSum, 129, 0},
                  {DirectKind::kScatter, DType::kFloat16, RedOp::kSum, 64, 0},
                  {DirectKind::kGather, DType::kInt32, RedOp::kSum, 300, R / 2},
                  {DirectKind::kReduce, DType::kFloat32, RedOp::kMax, 4099, last},
                  {DirectKind::kAllReduce, DType::kInt64, RedOp::kSum, 5, 0},
              };
              for (Direct algo : {Direct::kOneShot, Direct::kTwoShot}) {
                DeviceCollectives c(g.comm, r.store, prefix("x", algo), g.device, options(algo));
                std::vector<StepBuffers> bufs;
                for (const OpStep& s : steps) bufs.emplace_back(s, R, r.rank);
                auto put_inputs = [&](int tag) {
                  for (size_t i = 0; i < steps.size(); ++i) {
                    const OpStep& s = steps[i];
                    write(bufs[i].in->get(), input_of(s.kind, s.dtype, s.count, R, r.rank, s.root,
                                                      tag + static_cast<int>(i)));
                  }
                };
                auto check = [&](int tag, bool eager, const std::string& when) {
                  for (size_t i = 0; i < steps.size(); ++i) {
                    const OpStep& s = steps[i];
                    const auto& b = bufs[i];
                    const Bytes want = expected(s.kind, s.dtype, s.op, s.count, R, r.rank, s.root,
                                                tag + static_cast<int>(i), everyone(R));
                    const std::string what = when + ": step " + std::to_string(i) + " " +
                                             kind_name(s.kind) + " algo " +
                                             std::to_string(static_cast<int>(algo));
                    const Bytes got = read(b.out->get(), b.out_bytes);
                    EXPECT_EQ(got, want) << what;
                    if (eager) {
                      EXPECT_EQ(read(b.eager->get(), b.out_bytes), got) << "eager " << what;
                    }
                  }
                };
                // The first call sets the path up (a host op): eagerly, never under capture.
                put_inputs(0);
                EXPECT_FALSE(c.direct_ready());
                for (size_t i = 0; i < steps.size(); ++i)
                  c.direct(bufs[i].op(steps[i], false), g.stream);
                ASSERT_TRUE(c.direct_ready());
                sync(g.stream);
                check(0, false, "setup");
                cudaGraph_t graph = nullptr;
                cudaGraphExec_t exec = nullptr;
                mooncake::cuda_check(
                    cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeThreadLocal),
                    "begin capture");
                for (size_t i = 0; i < steps.size(); ++i)
                  c.direct(bufs[i].op(steps[i], false), g.stream);
                mooncake::cuda_check(cudaStreamEndCapture(g.stream, &graph), "end capture");
                mooncake::cuda_check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
                for (int replay = 1; replay <= 2; ++replay) {
                  const int tag = 100 * replay;
                  put_inputs(tag);
                  for (auto& b : bufs) fill(b.out->get(), kGuard, b.out_bytes);
                  mooncake::cuda_check(cudaGraphLaunch(exec, g.stream), "replay");
                  for (size_t i = 0; i < steps.size(); ++i)
                    c.direct(bufs[i].op(steps[i], true), g.stream);
                  sync(g.stream);
                  check(tag, true, "replay " + std::to_string(replay));
                }
                EXPECT_TRUE(c.direct_ready());
                cudaGraphExecDestroy(exec);
                cudaGraphDestroy(graph);
              }
            },
            {120000});
}

INSTANTIATE_TEST_SUITE_P(Worlds, DirectOpsTest, ::testing::Values(1, 2, 3));

// Launches queued on two streams of a rank with no order between them (as
// FSDP gathers on one stream and reduces on another) still run one after
// another, in the order they were made: they share the op count, the grid
// barrier and the areas. Every result is checked once both streams are done.
TEST(DirectOps, LaunchesOnTwoStreamsRunInTheOrderMade) {
  MC_REQUIRE_GPU();
  run_ranks(2,
            [](Rank& r) {
              GpuRank g(r);
              DeviceCollectives c(g.comm, r.store, "s/", g.device, options(Direct::kAuto));
              cudaStream_t s[2];
              for (cudaStream_t& st : s)
                mooncake::cuda_check(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking),
                                     "stream");
              const size_t n = 4096, rounds = 24;
              std::vector<std::unique_ptr<DeviceArray<float>>> in, out;
              for (size_t i = 0; i < rounds; ++i) {
                in.push_back(std::make_unique<DeviceArray<float>>(
                    std::vector<float>(n, static_cast<float>(r.rank * 100 + i))));
                out.push_back(std::make_unique<DeviceArray<float>>(2 * n));
              }
              for (size_t i = 0; i < rounds; ++i) {
                const bool gather = i % 2 == 0;
                c.direct(make_op(gather ? DirectKind::kAllGather : DirectKind::kAllReduce,
                                 in[i]->get(), out[i]->get(), n, DType::kFloat32),
                         s[i % 2]);
              }
              for (cudaStream_t st : s) sync(st);
              for (size_t i = 0; i < rounds; ++i) {
                const std::vector<float> got = out[i]->take();
                const auto f = static_cast<float>(i);
                for (size_t k = 0; k < n; ++k) {
                  if (i % 2 == 0) {
                    ASSERT_EQ(got[k], f) << "all_gather " << i << " at " << k;
                    ASSERT_EQ(got[n + k], 100 + f) << "all_gather " << i << " at " << n + k;
                  } else {
                    ASSERT_EQ(got[k], 100 + 2 * f) << "all_reduce " << i << " at " << k;
                  }
                }
              }
              EXPECT_TRUE(c.direct_ready());
              for (cudaStream_t st : s) cudaStreamDestroy(st);
            },
            {60000});
}

// Ranks that call with different counts each leave the other out of that op,
// and the next matching call covers both: they stay in step.
TEST(DirectOps, CallsThatDisagreeLeaveEachOtherOut) {
  MC_REQUIRE_GPU();
  run_ranks(2,
            [](Rank& r) {
              GpuRank g(r);
              DeviceCollectives c(g.comm, r.store, "m/", g.device, options(Direct::kAuto));
              const size_t n = 64;
              DeviceArray<float> x(std::vector<float>(n + 1, 1.0f));
              direct_all_reduce(c, x.get(), x.get(), n, DType::kFloat32, RedOp::kSum, g.stream);
              EXPECT_EQ(x.take()[0], 2.0f);
              const size_t mine = r.rank == 0 ? n : n + 1;
              DeviceArray<float> y(std::vector<float>(n + 1, 1.0f));
              direct_all_reduce(c, y.get(), y.get(), mine, DType::kFloat32, RedOp::kSum, g.stream);
              EXPECT_EQ(y.take()[0], 1.0f);  // its own input alone
              DeviceArray<float> z(std::vector<float>(n, 1.0f));
              direct_all_reduce(c, z.get(), z.get(), n, DType::kFloat32, RedOp::kSum, g.stream);
              EXPECT_EQ(z.take(), std::vector<float>(n, 2.0f));
            },
            {60000});
}

// Ranks that call another kind, or the same kind with another root, count,
// dtype or reduce op, each leave the other out of that op (zeros in its parts,
// a reduction of their own input alone) at once, without masking it (the
// caller's active_ranks keep it), and the next matching call covers both.
TEST(DirectOps, KindsAndRootsThatDisagreeLeaveEachOtherOut) {
  MC_REQUIRE_GPU();
  run_ranks(
      2,
      [](Rank& r) {
        GpuRank g(r);
        DeviceCollectives c(g.comm, r.store, "q/", g.device, options(Direct::kAuto));
        DeviceArray<int32_t> active(std::vector<int32_t>(2, 1));
        c.direct_report_to(active.get());
        const int me = r.rank, other = 1 - r.rank;
        const size_t n = 64;
        int tag = 0;
        // One op as this rank calls it (the other may call another); its
        // output against expected() over `in_op`.
        auto call = [&](DirectKind kind, DType dtype, RedOp op, size_t count, int root,
                        const std::vector<int>& in_op, const std::string& what) {
          namespace k = mooncake::kernels;
          ++tag;
          const size_t part = count * mooncake::dtype_size(dtype);
          const size_t in_bytes = k::direct_in_parts(kind, 2, me == root) * part;
          const size_t out_bytes = k::direct_out_parts(kind, 2, me == root) * part;
          DeviceArray<uint8_t> in(in_bytes), out(out_bytes);
          write(in.get(), input_of(kind, dtype, count, 2, me, root, tag));
          fill(out.get(), 0xff, out_bytes);
          c.direct(make_op(kind, in_bytes > 0 ? in.get() : nullptr,
                           out_bytes > 0 ? out.get() : nullptr, count, dtype, op, root),
                   g.stream, 60000);
          sync(g.stream);
          EXPECT_EQ(read(out.get(), out_bytes),
                    expected(kind, dtype, op, count, 2, me, root, tag, in_op))
              << what << " at rank " << me;
        };
        const std::vector<int> both{1, 1};
        std::vector<int> alone{0, 0};
        alone[static_cast<size_t>(me)] = 1;
        // Sets the path up.
        call(DirectKind::kAllGather, DType::kFloat32, RedOp::kSum, n, 0, both, "setup");
        const auto t0 = std::chrono::steady_clock::now();
        // Another kind of the same count: all_gather at rank 0, all_to_all at 1.
        call(me == 0 ? DirectKind::kAllGather : DirectKind::kAllToAll, DType::kFloat32, RedOp::kSum,
             n, 0, alone, "all_gather / all_to_all");
        // gather to different roots: each its own.
        call(DirectKind::kGather, DType::kFloat32, RedOp::kSum, n, me, alone, "gather, roots");
        // broadcast from the other: neither has a root's input, both get zeros.
        call(DirectKind::kBroadcast, DType::kFloat32, RedOp::kSum, n, other, alone,
             "broadcast, roots");
        // scatter from itself: each its own part.
        call(DirectKind::kScatter, DType::kFloat32, RedOp::kSum, n, me, alone, "scatter, roots");
        // reduce_scatter through other ops: each its own contribution alone.
        call(DirectKind::kReduceScatter, DType::kFloat32, me == 0 ? RedOp::kSum : RedOp::kMax, n, 0,
             alone, "reduce_scatter, ops");
        // reduce to rank 0 of other dtypes (the same element size).
        call(DirectKind::kReduce, me == 0 ? DType::kFloat32 : DType::kInt32, RedOp::kSum, n, 0,
             alone, "reduce, dtypes");
        // all_to_all of other counts.
        call(DirectKind::kAllToAll, DType::kFloat32, RedOp::kSum, me == 0 ? n : n + 1, 0, alone,
             "all_to_all, counts");
        // Found at once (no wait for a deadline), and nobody masked.
        EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
        EXPECT_EQ(active.take(), std::vector<int32_t>(2, 1));
        EXPECT_TRUE(c.direct_ready());
        // In step again: calls that match cover both.
        call(DirectKind::kAllToAll, DType::kFloat32, RedOp::kSum, n, 0, both, "all_to_all");
        call(DirectKind::kBroadcast, DType::kInt8, RedOp::kSum, 5, 1, both, "broadcast");
        call(DirectKind::kReduce, DType::kFloat32, RedOp::kSum, n, 0, both, "reduce");
      },
      {60000});
}

// A watched launch leaves, in its leased slot, which ranks took part and why
// a peer did not (DirectOutcomes): a clean call, a peer that rejected its
// call, a peer that called another kind. A slot no launch wrote reads as
// nothing; slots go back and are used again (600 launches, 300 in flight at
// once, past a chunk of slots), each read under its own ticket.
TEST(DirectOps, WatchedLaunchesLeaveWhoTookPartAndWhy) {
  MC_REQUIRE_GPU();
  run_ranks(
      2,
      [](Rank& r) {
        GpuRank g(r);
        DeviceCollectives c(g.comm, r.store, "w/", g.device, options(Direct::kAuto));
        const int me = r.rank;
        const size_t n = 64;
        DeviceArray<float> x(std::vector<float>(2 * n, 1.0f)), y(2 * n);
        // One watched call (`reject`: this rank's call is bad); its outcome.
        auto watched = [&](DirectKind kind, const char* reject = nullptr) {
          mooncake::DirectOutcomes::Lease lease = c.direct_watch();
          EXPECT_FALSE(lease.read().has_value()) << "a slot no launch wrote";
          DirectOp op = make_op(kind, x.get(), y.get(), n, DType::kFloat32);
          op.outcome = lease.device();
          op.ticket = lease.ticket();
          c.direct(op, g.stream, 60000, reject);
          sync(g.stream);
          const auto o = lease.read();
          EXPECT_TRUE(o.has_value()) << "the launch wrote its slot";
          return o.value_or(mooncake::kernels::DirectOutcome{});
        };
        // Sets the path up (a launch of its own, unwatched).
        direct_all_reduce(c, x.get(), y.get(), n, DType::kFloat32, RedOp::kSum, g.stream);
        sync(g.stream);
        auto o = watched(DirectKind::kBroadcast);
        EXPECT_EQ(o.took, 3u);
        EXPECT_EQ(o.present, 3u);
        EXPECT_EQ(o.rejected | o.mismatched | o.stale, 0u);
        // Rank 1 rejects its call: it takes part without data (in nothing of
        // its own); rank 0 finds it rejected.
        o = watched(DirectKind::kGather, me == 1 ? "bad gather_list" : nullptr);
        EXPECT_EQ(o.took, me == 0 ? 1u : 0u) << "rank " << me;
        EXPECT_EQ(o.rejected, me == 0 ? 2u : 0u) << "rank " << me;
        // Both were there, rank 1 without data.
        EXPECT_EQ(o.present, 3u) << "rank " << me;
        EXPECT_EQ(o.mismatched | o.stale, 0u);
        // Another kind at each: each finds the other mismatched, itself in.
        o = watched(me == 0 ? DirectKind::kBroadcast : DirectKind::kAllGather);
        EXPECT_EQ(o.took, 1u << me);
        EXPECT_EQ(o.mismatched, 1u << (1 - me));
        EXPECT_EQ(o.present, 3u);
        EXPECT_EQ(o.rejected | o.stale, 0u);
        // Slots reused: 600 launches, 300 in flight at once, every outcome its own.
        for (int batch = 0; batch < 2; ++batch) {
          std::vector<mooncake::DirectOutcomes::Lease> leases;
          std::vector<uint64_t> tickets;
          for (int i = 0; i < 300; ++i) {
            leases.push_back(c.direct_watch());
            DirectOp op = make_op(DirectKind::kAllReduce, x.get(), y.get(), n, DType::kFloat32);
            op.outcome = leases.back().device();
            op.ticket = leases.back().ticket();
            tickets.push_back(op.ticket);
            c.direct(op, g.stream, 60000);
          }
          sync(g.stream);
          for (size_t i = 0; i < leases.size(); ++i) {
            const auto got = leases[i].read();
            ASSERT_TRUE(got.has_value()) << "launch " << i << " of batch " << batch;
            EXPECT_EQ(got->took, 3u) << "launch " << i;
          }
          std::sort(tickets.begin(), tickets.end());
          EXPECT_EQ(std::unique(tickets.begin(), tickets.end()), tickets.end());
        }
        const std::vector<float> last = y.take();
        EXPECT_EQ(std::vector<float>(last.begin(), last.begin() + n), std::vector<float>(n, 2.0f))
            << "the last all_reduce";
        EXPECT_TRUE(c.direct_ready());
      },
      {60000});
}

// A rank's side of the three-rank death tests below: the kernels set up by an
// all_reduce of n ones, checked.
struct ThreeRanks {
  static constexpr size_t n = 4096;
  explicit ThreeRanks(Rank& r)
      : g(r), c(g.comm, r.store, "k/", g.device, options(Direct::kAuto)), in(ones()), out(n) {
    direct_all_reduce(c, in.get(), out.get(), n, DType::kFloat32, RedOp::kSum, g.stream, 60000);
    EXPECT_EQ(out.take(), std::vector<float>(n, 3.0f));
  }
  static std::vector<float> ones() { return std::vector<float>(n, 1.0f); }
  GpuRank g;
  DeviceCollectives c;
  DeviceArray<float> in, out;
};

// A rank dies between replays: the survivors' launches hear it from the host
// (the lost words) and mask it at once, far before the 60 s deadline; an op on
// the host then has them agree on a view without it, and the next call sets
// the path up among them, which the graph, captured before, runs with too.
TEST(DirectOps, SurvivorsMaskADeadRankAndSetUpAgainWithoutIt) {
  MC_REQUIRE_GPU();
  run_ranks(
      3,
      [](Rank& r) {
        ThreeRanks t(r);
        GpuRank& g = t.g;
        DeviceCollectives& c = t.c;
        DeviceArray<float>&in = t.in, &out = t.out;
        const size_t n = ThreeRanks::n;
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        mooncake::cuda_check(cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeThreadLocal),
                             "begin capture");
        direct_all_reduce(c, in.get(), out.get(), n, DType::kFloat32, RedOp::kSum, g.stream, 60000);
        mooncake::cuda_check(cudaStreamEndCapture(g.stream, &graph), "end capture");
        mooncake::cuda_check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
        mooncake::cuda_check(cudaGraphLaunch(exec, g.stream), "replay");
        EXPECT_EQ(out.take(), std::vector<float>(n, 3.0f));
        // The kernels read each peer's life page (LostWords::watch_life).
        for (int p = 0; p < 3; ++p)
          EXPECT_EQ(c.direct_lost_words()->has_life(p), p != r.rank) << "rank " << p;
        g.comm.barrier();
        if (r.rank == 2) exit_rank_abruptly();  // gone, as after a crash
        const auto t0 = std::chrono::steady_clock::now();
        out.put(std::vector<float>(n, -1.0f));
        mooncake::cuda_check(cudaGraphLaunch(exec, g.stream), "replay");
        sync(g.stream);
        EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
        EXPECT_EQ(out.take(), std::vector<float>(n, 2.0f));
        // Masked for good: the next launch does not wait for it.
        direct_all_reduce(c, in.get(), out.get(), n, DType::kFloat32, RedOp::kSum, g.stream, 60000);
        EXPECT_EQ(out.take(), std::vector<float>(n, 2.0f));
        // An op on the host finds it gone: the survivors agree on {0, 1}.
        DeviceArray<float> h(std::vector<float>(n, 1.0f));
        c.all_reduce(h.get(), h.get(), n, DType::kFloat32, RedOp::kSum, g.stream);
        EXPECT_EQ(h.take(), std::vector<float>(n, 2.0f));
        EXPECT_FALSE(g.comm.view().is_member(2));
        EXPECT_FALSE(c.direct_ready());  // a new view: set up again
        direct_all_reduce(c, in.get(), out.get(), n, DType::kFloat32, RedOp::kSum, g.stream, 60000);
        EXPECT_TRUE(c.direct_ready());
        EXPECT_EQ(out.take(), std::vector<float>(n, 2.0f));
        EXPECT_FALSE(c.direct_lost_words()->has_life(2)) << "the dead rank's page stayed";
        EXPECT_TRUE(c.direct_lost_words()->has_life(1 - r.rank));
        out.put(std::vector<float>(n, -1.0f));
        mooncake::cuda_check(cudaGraphLaunch(exec, g.stream), "replay");
        EXPECT_EQ(out.take(), std::vector<float>(n, 2.0f));
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
      },
      {60000});
}

// A rank dies while the survivors' launch already waits for it (its news comes
// after their first look at the lost words): the waits read the words again and
// mask it far before the 60 s deadline.
TEST(DirectOps, SurvivorsWaitingForARankHearOfItsDeath) {
  MC_REQUIRE_GPU();
  run_ranks(
      3,
      [](Rank& r) {
        ThreeRanks t(r);
        t.g.comm.barrier();
        if (r.rank == 2) {
          std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the others wait by now
          exit_rank_abruptly();
        }
        const auto t0 = std::chrono::steady_clock::now();
        direct_all_reduce(t.c, t.in.get(), t.out.get(), ThreeRanks::n, DType::kFloat32, RedOp::kSum,
                          t.g.stream, 60000);
        EXPECT_EQ(t.out.take(), std::vector<float>(ThreeRanks::n, 2.0f));
        EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
      },
      {60000});
}

// The same for the moves: a rank dies between launches of an all_gather (and
// replays of a captured one); the survivors return at once with its part
// zero-filled, mark it in the caller's active_ranks, leave it out of the
// other kinds too (zeros from it as a root, reductions over the survivors),
// and after the host's view without it set up again among themselves.
TEST(DirectOps, SurvivorsZeroADeadRanksPartsAndSetUpAgainWithoutIt) {
  MC_REQUIRE_GPU();
  run_ranks(
      3,
      [](Rank& r) {
        GpuRank g(r);
        DeviceCollectives c(g.comm, r.store, "z/", g.device, options(Direct::kAuto));
        DeviceArray<int32_t> active(std::vector<int32_t>(3, 1));
        c.direct_report_to(active.get());  // before the first call sets the path up
        const int me = r.rank;
        const size_t n = 1000, part = n * 4;
        const DType f32 = DType::kFloat32;
        const int tag = 7;
        DeviceArray<uint8_t> in(part), out(3 * part);
        write(in.get(), input_of(DirectKind::kAllGather, f32, n, 3, me, 0, tag));
        const DirectOp gather = make_op(DirectKind::kAllGather, in.get(), out.get(), n, f32);
        auto want = [&](const std::vector<int>& in_op) {
          return expected(DirectKind::kAllGather, f32, RedOp::kSum, n, 3, me, 0, tag, in_op);
        };
        const std::vector<int> all{1, 1, 1}, survivors{1, 1, 0};
        c.direct(gather, g.stream, 60000);
        sync(g.stream);
        EXPECT_EQ(read(out.get(), 3 * part), want(all));
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        mooncake::cuda_check(cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeThreadLocal),
                             "begin capture");
        c.direct(gather, g.stream, 60000);
        mooncake::cuda_check(cudaStreamEndCapture(g.stream, &graph), "end capture");
        mooncake::cuda_check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
        fill(out.get(), 0xff, 3 * part);
        mooncake::cuda_check(cudaGraphLaunch(exec, g.stream), "replay");
        sync(g.stream);
        EXPECT_EQ(read(out.get(), 3 * part), want(all));
        g.comm.barrier();
        if (me == 2) exit_rank_abruptly();  // gone, as after a crash
        const auto t0 = std::chrono::steady_clock::now();
        fill(out.get(), 0xff, 3 * part);
        c.direct(gather, g.stream, 60000);
        sync(g.stream);
        EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
        EXPECT_EQ(read(out.get(), 3 * part), want(survivors));
        EXPECT_EQ(active.take(), std::vector<int32_t>({1, 1, 0}));
        // Masked for good: replays and the other kinds do not wait for it.
        fill(out.get(), 0xff, 3 * part);
        mooncake::cuda_check(cudaGraphLaunch(exec, g.stream), "replay");
        sync(g.stream);
        EXPECT_EQ(read(out.get(), 3 * part), want(survivors));
        {
          DeviceArray<uint8_t> a2a_in(3 * part), a2a_out(3 * part), one(part);
          write(a2a_in.get(), input_of(DirectKind::kAllToAll, f32, n, 3, me, 0, tag + 1));
          fill(a2a_out.get(), 0xff, 3 * part);
          c.direct(make_op(DirectKind::kAllToAll, a2a_in.get(), a2a_out.get(), n, f32), g.stream,
                   60000);
          sync(g.stream);
          EXPECT_EQ(read(a2a_out.get(), 3 * part), expected(DirectKind::kAllToAll, f32, RedOp::kSum,
                                                            n, 3, me, 0, tag + 1, survivors));
          // A broadcast from the dead rank: zeros.
          fill(one.get(), 0xff, part);
          c.direct(make_op(DirectKind::kBroadcast, nullptr, one.get(), n, f32, RedOp::kSum, 2),
                   g.stream, 60000);
          sync(g.stream);
          EXPECT_EQ(read(one.get(), part), Bytes(part, 0));
          // reduce_scatter over the survivors (the input of all_to_all's shape).
          c.direct(
              make_op(DirectKind::kReduceScatter, a2a_in.get(), one.get(), n, f32, RedOp::kSum),
              g.stream, 60000);
          sync(g.stream);
          EXPECT_EQ(read(one.get(), part), expected(DirectKind::kReduceScatter, f32, RedOp::kSum, n,
                                                    3, me, 0, tag + 1, survivors));
        }
        EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
        // An op on the host finds it gone: the survivors agree on {0, 1}, and
        // the plane zero-fills its part too.
        DeviceArray<uint8_t> plane(3 * part);
        fill(plane.get(), 0xff, 3 * part);
        EXPECT_TRUE(on_plane(c, gather, in.get(), plane.get(), 3, me, g.stream));
        sync(g.stream);
        EXPECT_EQ(read(plane.get(), 3 * part), want(survivors));
        EXPECT_FALSE(g.comm.view().is_member(2));
        EXPECT_FALSE(c.direct_ready());  // a new view: set up again
        fill(out.get(), 0xff, 3 * part);
        c.direct(gather, g.stream, 60000);
        sync(g.stream);
        EXPECT_TRUE(c.direct_ready());
        EXPECT_EQ(read(out.get(), 3 * part), want(survivors));
        fill(out.get(), 0xff, 3 * part);
        mooncake::cuda_check(cudaGraphLaunch(exec, g.stream), "replay");
        sync(g.stream);
        EXPECT_EQ(read(out.get(), 3 * part), want(survivors));
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
      },
      {60000});
}

}  // namespace
}  // namespace mctest
