// The ucx transport's receiving side, driven message by message from a raw
// UCX endpoint in the test: messages that break the protocol are dropped and
// counted, and nothing of theirs lands in the segment; a signal is held back
// until the writes sent before it have landed, whatever order they arrive
// in; a message from an older incarnation or link of a slot than one already
// heard from never lands.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "core/clock.h"
#include "transport/secret.h"
#include "transport/segment.h"
#include "transport/tcp_wire.h"
#include "transport/ucx.h"

#ifdef MOONCAKE_HAVE_UCX
#include <ucp/api/ucp.h>

namespace mctest {
namespace {

using mooncake::load_flag;
using mooncake::UcxHeader;

constexpr unsigned kAmId = 0x6d63;  // the transport's, pinned here
constexpr size_t kUcxBytes = 1 << 16;
constexpr size_t kUcxFlag = mooncake::kSegmentHeaderBytes;
constexpr size_t kUcxData = kUcxFlag + 64;
constexpr uint8_t kUcxCanary = 0xA5;

// A bare UCX worker with one endpoint to the receiver, progressed by the test.
class RawSender {
 public:
  explicit RawSender(const std::string& address_hex) {
    ucp_params_t p{};
    p.field_mask = UCP_PARAM_FIELD_FEATURES;
    p.features = UCP_FEATURE_AM;
    ucp_config_t* config = nullptr;
    EXPECT_EQ(ucp_config_read(nullptr, nullptr, &config), UCS_OK);
    EXPECT_EQ(ucp_init(&p, config, &context_), UCS_OK);
    ucp_config_release(config);
    ucp_worker_params_t wp{};
    EXPECT_EQ(ucp_worker_create(context_, &wp, &worker_), UCS_OK);
    std::vector<uint8_t> addr(address_hex.size() / 2);
    for (size_t i = 0; i < addr.size(); ++i)
      addr[i] = static_cast<uint8_t>(std::stoi(address_hex.substr(2 * i, 2), nullptr, 16));
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep.address = reinterpret_cast<const ucp_address_t*>(addr.data());
    EXPECT_EQ(ucp_ep_create(worker_, &ep, &ep_), UCS_OK);
  }
  ~RawSender() {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    wait(ucp_ep_close_nbx(ep_, &p));
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
  }

  void send(const void* header, size_t header_bytes, const void* data, size_t bytes) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_EAGER;
    wait(ucp_am_send_nbx(ep_, kAmId, header, header_bytes, data, bytes, &p));
  }

 private:
  void wait(ucs_status_ptr_t r) {
    if (r == nullptr || UCS_PTR_IS_ERR(r)) return;
    while (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(worker_);
    ucp_request_free(r);
  }

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
};

class HostileUcx : public testing::Test {
 protected:
  HostileUcx()
      : secret_(mooncake::random_secret()),
        segment_(kUcxBytes),
        worker_(segment_, 4, secret_, {}, nullptr),
        sender_(worker_.address()) {
    std::memset(segment_.base() + kUcxFlag, kUcxCanary, kUcxBytes - kUcxFlag);
  }

  UcxHeader header(uint32_t type, uint64_t seq, uint64_t offset = kUcxData) const {
    UcxHeader h{};
    h.type = type;
    h.offset = offset;
    h.flag = kUcxFlag;
    h.value = 7;
    h.link = 1;
    h.seq = seq;
    h.rank = 2;
    h.inc = 0;
    std::memcpy(h.secret, secret_.data(), mooncake::kSecretBytes);
    return h;
  }
  void send(const UcxHeader& h, const std::vector<uint8_t>& payload = {}) {
    sender_.send(&h, sizeof(h), payload.data(), payload.size());
  }
  // Waits until the receiver has dropped `n` messages in all (false after 5 s).
  bool rejected(uint64_t n) {
    const int64_t until = mooncake::now_us() + 5000000;
    while (worker_.rejected() < n && mooncake::now_us() < until) std::this_thread::yield();
    return worker_.rejected() == n;
  }
  // Waits up to `ms` for the flag to hold `value`.
  bool flag_is(uint64_t value, int64_t ms = 5000) {
    const int64_t until = mooncake::now_us() + ms * 1000;
    while (load_flag(segment_.base(), kUcxFlag) != value && mooncake::now_us() < until)
      std::this_thread::yield();
    return load_flag(segment_.base(), kUcxFlag) == value;
  }
  bool untouched(size_t from = kUcxData, size_t to = kUcxBytes) const {
    for (size_t i = from; i < to; ++i)
      if (segment_.base()[i] != kUcxCanary) return false;
    return true;
  }

  std::string secret_;
  mooncake::Segment segment_;
  mooncake::UcxWorker worker_;
  RawSender sender_;
};

TEST_F(HostileUcx, MessagesThatBreakTheProtocolAreDroppedAndCounted) {
  const std::vector<uint8_t> payload(256, 0x11);
  uint64_t expected = 0;
  UcxHeader wrong = header(mooncake::kWrite, 1);
  wrong.secret[0] ^= 1;
  send(wrong, payload);
  ASSERT_TRUE(rejected(++expected)) << "a wrong secret";
  UcxHeader slot = header(mooncake::kWrite, 1);
  slot.rank = 4;
  send(slot, payload);
  ASSERT_TRUE(rejected(++expected)) << "a slot past the capacity";
  send(header(mooncake::kWrite, 1, kUcxBytes - 100), payload);
  ASSERT_TRUE(rejected(++expected)) << "a write past the segment";
  UcxHeader flag = header(mooncake::kSignal, 0);
  flag.flag = kUcxBytes - 4;
  send(flag);
  ASSERT_TRUE(rejected(++expected)) << "a flag past the segment";
  flag.flag = kUcxFlag + 3;
  send(flag);
  ASSERT_TRUE(rejected(++expected)) << "an unaligned flag";
  UcxHeader bell = header(mooncake::kSignal, 0);
  bell.bell = mooncake::kNumBells;
  send(bell);
  ASSERT_TRUE(rejected(++expected)) << "a bell that does not exist";
  send(header(99, 0));
  ASSERT_TRUE(rejected(++expected)) << "an unknown type";
  const uint64_t small[2] = {1, 2};
  sender_.send(small, sizeof(small), payload.data(), payload.size());
  ASSERT_TRUE(rejected(++expected)) << "a short header";
  EXPECT_TRUE(untouched(kUcxFlag)) << "a dropped message left bytes in the segment";
  // The receiver still takes a good message.
  send(header(mooncake::kWrite, 1), payload);
  send(header(mooncake::kSignal, 1));
  EXPECT_TRUE(flag_is(7));
  EXPECT_EQ(segment_.base()[kUcxData], 0x11);
  EXPECT_TRUE(untouched(kUcxData + payload.size()));
}

TEST_F(HostileUcx, ASignalWaitsForTheWritesSentBeforeIt) {
  const std::vector<uint8_t> first(128, 0x21), second(128, 0x22);
  send(header(mooncake::kSignal, 2));  // arrives before both of its writes
  send(header(mooncake::kWrite, 2, kUcxData + 128), second);
  send(header(mooncake::kWrite, 3, kUcxData + 256), second);  // a later write: not waited for
  EXPECT_FALSE(flag_is(7, 300)) << "the signal overtook write 1";
  send(header(mooncake::kWrite, 1), first);
  EXPECT_TRUE(flag_is(7));
  EXPECT_EQ(segment_.base()[kUcxData], 0x21);
  EXPECT_EQ(segment_.base()[kUcxData + 128], 0x22);
  EXPECT_EQ(worker_.rejected(), 0u);
}

TEST_F(HostileUcx, OlderIncarnationsAndLinksNeverLand) {
  const std::vector<uint8_t> payload(64, 0x31);
  UcxHeader newer = header(mooncake::kSignal, 0);
  newer.inc = 1;
  newer.value = 5;
  send(newer);
  ASSERT_TRUE(flag_is(5));
  UcxHeader old = header(mooncake::kWrite, 1);  // incarnation 0
  send(old, payload);
  UcxHeader old_signal = header(mooncake::kSignal, 1);
  old_signal.value = 9;
  send(old_signal);
  UcxHeader old_link = header(mooncake::kWrite, 1);
  old_link.inc = 1;
  old_link.link = 0;
  send(old_link, payload);
  // A message of the current link after them: once it lands, the older
  // ones were seen (and dropped) already.
  newer.value = 6;
  send(newer);
  ASSERT_TRUE(flag_is(6));
  EXPECT_TRUE(untouched()) << "a write of a replaced process or link landed";
  EXPECT_EQ(worker_.rejected(), 0u);  // stale, not hostile: dropped quietly
}

}  // namespace
}  // namespace mctest

#else

TEST(HostileUcx, NotInThisBuild) {
  GTEST_SKIP() << "the build has no ucx transport";
}

#endif  // MOONCAKE_HAVE_UCX
