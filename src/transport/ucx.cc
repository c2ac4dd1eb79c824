#include "transport/ucx.h"

#include <dirent.h>

#include <algorithm>
#include <cstring>
#include <string_view>

#include "core/error.h"

namespace mooncake {

std::vector<std::string> rdma_devices() {
  std::vector<std::string> out;
  const std::string root = "/sys/class/infiniband";
  DIR* d = ::opendir(root.c_str());
  if (d == nullptr) return out;
  while (dirent* e = ::readdir(d)) {
    const std::string dev = e->d_name;
    if (dev.empty() || dev[0] == '.') continue;
    DIR* ports = ::opendir((root + "/" + dev + "/ports").c_str());
    if (ports == nullptr) continue;
    while (dirent* p = ::readdir(ports))
      if (p->d_name[0] != '.') out.push_back(dev + ":" + p->d_name);
    ::closedir(ports);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace mooncake

#ifndef MOONCAKE_HAVE_UCX

namespace mooncake {

bool ucx_built() {
  return false;
}

struct UcxWorker::Core {};

UcxWorker::UcxWorker(Segment&, int, std::string, const std::vector<std::string>&,
                     std::atomic<uint64_t>*) {
  throw_error(ErrorKind::kInvalidArgument, -1,
              "the ucx transport is not in this build: libucx-dev was missing when it was built "
              "(install it and rebuild, or use MOONCAKE_TRANSPORT=auto or tcp)");
}
UcxWorker::~UcxWorker() = default;
const std::string& UcxWorker::address() const {
  static const std::string none;
  return none;
}
uint64_t UcxWorker::rejected() const {
  return 0;
}
std::unique_ptr<PeerLink> UcxWorker::connect(const PeerAddress&, int, uint32_t) {
  return nullptr;
}

}  // namespace mooncake

#else  // MOONCAKE_HAVE_UCX

#include <poll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "core/clock.h"
#include "core/hex.h"
#include "core/log.h"
#include "core/thread.h"
#include "core/wait.h"
#include "transport/tcp_wire.h"

namespace mooncake {

bool ucx_built() {
  return true;
}

namespace {

constexpr unsigned kAmId = 0x6d63;  // "mc"

[[noreturn]] void ucx_fail(const char* what, ucs_status_t st) {
  throw_error(ErrorKind::kSystem, -1, "ucx: ", what, " failed: ", ucs_status_string(st));
}

// Whether UCX_TLS (unset: UCX's default, every transport) lets UCX use an
// RDMA transport.
bool rdma_allowed(const char* tls) {
  if (tls == nullptr) return true;
  const std::string_view t(tls);
  if (t.starts_with('^')) return true;  // a list of transports to leave out
  for (std::string_view name : {"all", "rc", "dc", "ud", "ib"})
    if (t.find(name) != std::string_view::npos) return true;
  return false;
}

// The worker address `addr` publishes, decoded.
std::vector<uint8_t> worker_address(const PeerAddress& addr) {
  auto bytes = from_hex(addr.ucx_address);
  if (!bytes)
    throw_error(ErrorKind::kInternal, addr.rank, "rank ", addr.rank,
                " published a malformed ucx address");
  return std::move(*bytes);
}

}  // namespace

struct UcxWorker::Core {
  // What the receiver knows of one slot's sender: the latest incarnation and
  // link heard from, which of that link's writes have landed, and the
  // signals waiting for earlier writes.
  struct Pending {
    uint64_t seq;
    uint32_t type;
    uint32_t bell;
    uint64_t offset;
    uint64_t value;
  };
  struct From {
    uint32_t inc_plus1 = 0;
    uint64_t link = 0;
    uint64_t landed = 0;            // every write numbered <= landed has landed
    std::set<uint64_t> landed_out;  // writes above that which landed early
    std::vector<Pending> pending;   // in arrival order
    std::atomic<uint64_t> frames{0};
  };
  // A rendezvous write on its way into the segment.
  struct Arriving {
    Core* core;
    int rank;
    uint32_t inc;
    uint64_t link;
    uint64_t seq;
  };

  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  std::string address;
  uint8_t* base;
  size_t size;
  int capacity;
  std::string secret;
  std::atomic<uint64_t>* alarm;
  // Every call into UCX holds ucx_mu (the worker is serialized): a sleeping
  // lock, where UCX's own multi-thread mode spins, and eight ranks share two
  // cores. Callbacks run inside progress, under it; they take mu (the
  // senders' state) after it, never the other way round.
  std::mutex ucx_mu;
  std::mutex mu;
  std::unique_ptr<From[]> from;
  std::atomic<uint64_t> rejected{0};
  std::atomic<uint64_t> next_link{1};
  // Large writes go eagerly (streamed; the receiver copies them out of UCX's
  // buffers) where UCX runs over tcp or shared memory: its rendezvous there
  // costs round trips per write for no zero-copy gain (8 MiB all_reduce at
  // world 3: 31 ms against 17 eagerly). Over RDMA, rendezvous reads the
  // payload straight into the segment.
  bool eager_writes = true;
  int efd = -1;
  int wake_fd = -1;
  std::atomic<bool> stop{false};
  bool closed = false;  // under mu: the segment is gone; nothing lands any more
  std::thread progress;
  LogLimiter log_limit{kWarningsPerSecond};  // under mu

  Core(uint8_t* b, size_t n, int cap, std::string s, std::atomic<uint64_t>* a)
      : base(b), size(n), capacity(cap), secret(std::move(s)), alarm(a), from(new From[cap]) {}

  ~Core() {
    if (worker) {
      // Let wireup messages that UCX queued for its own endpoints (peers that
      // connected here) go out first: UCX 1.13 asserts when
      // ucp_worker_destroy purges a queued wireup reply. Bounded: 20 ms
      // without progress, 200 ms in all (a peer that is gone never takes it).
      const int64_t start = now_us();
      int64_t last = start;
      for (int64_t now = start; now - last < 20000 && now - start < 200000; now = now_us()) {
        if (ucp_worker_progress(worker) != 0)
          last = now;
        else
          ::usleep(1000);
      }
      ucp_worker_destroy(worker);
    }
    if (context) ucp_cleanup(context);
    if (wake_fd >= 0) ::close(wake_fd);
  }

  void wake_waiters() {
    std::lock_guard<std::mutex> lock(mu);
    if (closed) return;
    for (int b = 0; b < kNumBells; ++b) ring(&reinterpret_cast<SegmentHeader*>(base)->bells[b]);
  }

  void reject(const std::string& why) {
    rejected.fetch_add(1, std::memory_order_relaxed);
    if (log_limit.allow("ucx messages dropped")) MC_LOG(kWarn, "ucx: dropped a message: ", why);
  }

  // Under mu: the state of `h`'s sender, or null when `h` is stale.
  From* sender(const UcxHeader& h) {
    From& f = from[h.rank];
    if (h.inc + 1 < f.inc_plus1 || (h.inc + 1 == f.inc_plus1 && h.link < f.link)) return nullptr;
    if (h.inc + 1 > f.inc_plus1 || h.link > f.link) {
      f.inc_plus1 = h.inc + 1;
      f.link = h.link;
      f.landed = 0;
      f.landed_out.clear();
      f.pending.clear();
      f.frames.store(0, std::memory_order_relaxed);
    }
    return &f;
  }

  void apply(const Pending& p) {
    if (p.type == kSignalMax)
      store_flag_max(base, p.offset, p.value);
    else
      store_flag(base, p.offset, p.value);
    ring(&reinterpret_cast<SegmentHeader*>(base)->bells[p.bell]);
  }

  // Under mu: write `seq` of `f`'s link has landed; releases the signals
  // that waited for it.
  void landed(From& f, uint64_t seq) {
    if (seq != f.landed + 1) {
      f.landed_out.insert(seq);
      return;
    }
    f.landed = seq;
    while (!f.landed_out.empty() && *f.landed_out.begin() == f.landed + 1) {
      f.landed_out.erase(f.landed_out.begin());
      ++f.landed;
    }
    size_t kept = 0;
    for (const Pending& p : f.pending) {
      if (p.seq <= f.landed)
        apply(p);
      else
        f.pending[kept++] = p;
    }
    f.pending.resize(kept);
  }

  static void rndv_done(void* request, ucs_status_t status, size_t, void* user) {
    auto* a = static_cast<Arriving*>(user);
    Core& c = *a->core;
    {
      std::lock_guard<std::mutex> lock(c.mu);
      From& f = c.from[a->rank];
      if (status != UCS_OK)
        // The payload did not land: the signals after it stay held back, and
        // whoever waits for them finds the peer gone or silent.
        MC_LOG(kWarn, "ucx: a write from rank ", a->rank,
               " did not arrive: ", ucs_status_string(status));
      else if (!c.closed && f.inc_plus1 == a->inc + 1 && f.link == a->link)
        c.landed(f, a->seq);
    }
    if (request != nullptr) ucp_request_free(request);
    delete a;
  }

  static ucs_status_t on_message(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param) {
    auto& c = *static_cast<Core*>(arg);
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    std::unique_lock<std::mutex> lock(c.mu);
    if (header_length != sizeof(UcxHeader)) {
      c.reject(str("a header of ", header_length, " bytes"));
      return UCS_OK;
    }
    UcxHeader h;
    std::memcpy(&h, header, sizeof(h));
    if (!secret_matches(h.secret, c.secret)) {
      c.reject("it carries the wrong secret (another group, or not a peer)");
      return UCS_OK;
    }
    if (h.rank < 0 || h.rank >= c.capacity || h.inc == UINT32_MAX) {
      c.reject(str("it names slot ", h.rank, " of ", c.capacity));
      return UCS_OK;
    }
    if (c.closed) return UCS_OK;  // the segment is going away with its endpoint
    From* f = c.sender(h);
    if (f == nullptr) return UCS_OK;  // from a replaced process or link: never lands
    f->frames.fetch_add(1, std::memory_order_relaxed);
    switch (h.type) {
      case kHeartbeat:
      case kBye: return UCS_OK;
      case kSignal:
      case kSignalMax: {
        if (h.flag > c.size - 8 || h.flag % 8 != 0 || h.bell >= static_cast<uint32_t>(kNumBells) ||
            h.offset > c.size || length > c.size - h.offset || (length != 0 && rndv)) {
          c.reject(str("rank ", h.rank, " signals a flag outside the segment (flag ", h.flag,
                       ", bell ", h.bell, ", ", length, " bytes at ", h.offset, ")"));
          return UCS_OK;
        }
        // Its own payload: the writes before it were sent first, so it lands now.
        if (length != 0) std::memcpy(c.base + h.offset, data, length);
        const Pending p{h.seq, h.type, h.bell, h.flag, h.value};
        if (h.seq <= f->landed)
          c.apply(p);
        else
          f->pending.push_back(p);
        return UCS_OK;
      }
      case kWrite: {
        if (h.offset > c.size || length > c.size - h.offset) {
          c.reject(str("rank ", h.rank, " writes ", length, " bytes at offset ", h.offset,
                       ", outside the ", c.size, "-byte segment"));
          return UCS_OK;
        }
        if (h.seq <= f->landed || f->landed_out.count(h.seq) != 0) {
          c.reject(str("rank ", h.rank, " repeats write ", h.seq, " of its link"));
          return UCS_OK;
        }
        if (!rndv) {
          std::memcpy(c.base + h.offset, data, length);
          c.landed(*f, h.seq);
          return UCS_OK;
        }
        auto* a = new Arriving{&c, h.rank, h.inc, h.link, h.seq};
        lock.unlock();  // the receive may complete at once, and its callback takes mu
        ucp_request_param_t p{};
        p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        p.cb.recv_am = &Core::rndv_done;
        p.user_data = a;
        ucs_status_ptr_t r = ucp_am_recv_data_nbx(c.worker, data, c.base + h.offset, length, &p);
        if (r == nullptr)
          rndv_done(nullptr, UCS_OK, length, a);
        else if (UCS_PTR_IS_ERR(r))
          rndv_done(nullptr, UCS_PTR_STATUS(r), 0, a);
        return UCS_INPROGRESS;
      }
      default: c.reject(str("rank ", h.rank, " sent a message of unknown type ", h.type));
    }
    return UCS_OK;
  }

  void progress_loop() {
    while (!stop.load(std::memory_order_acquire)) {
      ucs_status_t st;
      {
        std::lock_guard<std::mutex> lock(ucx_mu);
        // A bounded burst, so that senders get the worker in between.
        for (int i = 0; i < 64 && ucp_worker_progress(worker) != 0; ++i) {
        }
        st = ucp_worker_arm(worker);
      }
      if (st == UCS_ERR_BUSY) continue;
      pollfd fds[2] = {{efd, POLLIN, 0}, {wake_fd, POLLIN, 0}};
      ::poll(fds, 2, 100);
    }
  }
};

UcxWorker::UcxWorker(Segment& segment, int capacity, std::string secret,
                     const std::vector<std::string>& devices, std::atomic<uint64_t>* alarm)
    : core_(std::make_shared<Core>(segment.base(), segment.size(), capacity, std::move(secret),
                                   alarm)) {
  check_secret(core_->secret, "ucx");
  Core& c = *core_;
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) ucx_fail("reading the configuration", st);
  if (!devices.empty()) {
    // An HCA named without a port ("mlx5_0", as set_device_filter takes it)
    // stands for each of its ports; other names go to UCX as they are.
    const std::vector<std::string> ports = rdma_devices();
    std::string list;
    for (const auto& d : devices) {
      bool expanded = false;
      if (d.find(':') == std::string::npos)
        for (const auto& p : ports)
          if (p.starts_with(d + ":")) {
            list += (list.empty() ? "" : ",") + p;
            expanded = true;
          }
      if (!expanded) list += (list.empty() ? "" : ",") + d;
    }
    st = ucp_config_modify(config, "NET_DEVICES", list.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      throw_error(ErrorKind::kInvalidArgument, -1, "ucx: the device filter '", list,
                  "' was refused: ", ucs_status_string(st));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.name = "mooncake";
  st = ucp_init(&params, config, &c.context);
  ucp_config_release(config);
  if (st != UCS_OK) ucx_fail("ucp_init", st);
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  st = ucp_worker_create(c.context, &wp, &c.worker);
  if (st != UCS_OK) ucx_fail("ucp_worker_create", st);
  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  st = ucp_worker_get_address(c.worker, &addr, &addr_len);
  if (st != UCS_OK) ucx_fail("ucp_worker_get_address", st);
  c.address = to_hex(addr, addr_len);
  ucp_worker_release_address(c.worker, addr);
  ucp_am_handler_param_t hp{};
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  hp.id = kAmId;
  hp.flags = UCP_AM_FLAG_WHOLE_MSG;
  hp.cb = &Core::on_message;
  hp.arg = &c;
  st = ucp_worker_set_am_recv_handler(c.worker, &hp);
  if (st != UCS_OK) ucx_fail("ucp_worker_set_am_recv_handler", st);
  st = ucp_worker_get_efd(c.worker, &c.efd);
  if (st != UCS_OK) ucx_fail("ucp_worker_get_efd", st);
  c.eager_writes = rdma_devices().empty() || !rdma_allowed(std::getenv("UCX_TLS"));
  c.wake_fd = MC_SYSCHECK(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  c.progress = std::thread([&c] {
    begin_library_thread("mc-ucx");
    c.progress_loop();
  });
}

UcxWorker::~UcxWorker() {
  if (!core_ || !core_->progress.joinable()) return;
  core_->stop.store(true, std::memory_order_release);
  uint64_t one = 1;
  if (::write(core_->wake_fd, &one, sizeof(one)) < 0) { /* the thread polls with a timeout */
  }
  core_->progress.join();
  std::lock_guard<std::mutex> lock(core_->mu);
  core_->closed = true;
}

const std::string& UcxWorker::address() const {
  return core_->address;
}
uint64_t UcxWorker::rejected() const {
  return core_->rejected.load(std::memory_order_relaxed);
}

namespace {

// What an endpoint's error callback reaches: it lives as long as the link.
struct EpState {
  std::shared_ptr<UcxWorker::Core> core;
  std::atomic<bool> failed{false};
};

void on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* s = static_cast<EpState*>(arg);
  if (!s->failed.exchange(true)) {
    MC_LOG(kDebug, "ucx: endpoint failed: ", ucs_status_string(status));
    if (s->core->alarm) s->core->alarm->fetch_add(1, std::memory_order_acq_rel);
    s->core->wake_waiters();
  }
}

// Until a first message has gone through, an endpoint error is taken for a
// connection that is not up yet (the peer's listener busy or slow under
// load: "connection refused"), and the link opens a new endpoint, for up to
// this long; after that, an error means the peer is gone.
constexpr int64_t kConnectRetryMs = 10000;

class UcxLink : public PeerLink {
 public:
  UcxLink(std::shared_ptr<UcxWorker::Core> core, const PeerAddress& addr, int my_rank,
          uint32_t my_inc)
      : core_(std::move(core)),
        remote_(worker_address(addr)),
        peer_(addr.rank),
        peer_inc_(addr.incarnation),
        peer_bytes_(addr.segment_bytes),
        link_(core_->next_link.fetch_add(1)),
        retry_until_us_(now_us() + kConnectRetryMs * 1000) {
    open();
    std::memset(&hdr_, 0, sizeof(hdr_));
    hdr_.link = link_;
    hdr_.rank = my_rank;
    hdr_.inc = my_inc;
    std::memcpy(hdr_.secret, core_->secret.data(), kSecretBytes);
  }

  ~UcxLink() override {
    close();
    const std::vector<void*> closing = closing_;
    for (void* c : closing) finish(c, Deadline::after_ms(1000), "closing");
  }

  const char* transport() const override { return "ucx"; }

  void write(size_t offset, const void* src, size_t len, const Deadline& deadline) override {
    MC_ASSERT(offset + len <= peer_bytes_, "write past the peer segment");
    std::lock_guard<std::mutex> lock(mu_);
    if (!held_.empty() && offset != held_at_ + held_.size()) flush(deadline);
    if (held_.size() + len <= kHoldBytes) {
      if (held_.empty()) held_at_ = offset;
      const auto* p = static_cast<const uint8_t*>(src);
      held_.insert(held_.end(), p, p + len);
      return;
    }
    if (held_.empty()) {
      send(kWrite, 0, offset, 0, 0, ++writes_, src, len, deadline, ucp_dt_make_contig(1),
           write_flags());
      return;
    }
    // What is held and this write are contiguous: one message of both.
    ucp_dt_iov_t iov[2] = {{held_.data(), held_.size()}, {const_cast<void*>(src), len}};
    send(kWrite, 0, held_at_, 0, 0, ++writes_, iov, 2, deadline, ucp_dt_make_iov(), write_flags());
    held_.clear();
  }
  void signal(size_t offset, uint64_t value, int bell, const Deadline& deadline) override {
    send_signal(kSignal, offset, value, bell, deadline);
  }
  void signal_max(size_t offset, uint64_t value, int bell, const Deadline& deadline) override {
    send_signal(kSignalMax, offset, value, bell, deadline);
  }
  bool alive() override {
    if (!failed()) return true;
    if (!retryable()) return false;
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock()) return true;  // a sender holds the link, and retries itself
    if (reopen()) return true;
    // Said once, final: a new endpoint to a dead peer can still be created
    // now and then (its connect in flight when the call returns), and a peer
    // seen dead must not come back.
    given_up_.store(true, std::memory_order_release);
    return false;
  }
  uint64_t heartbeat() override {
    const auto& f = core_->from[peer_];
    std::lock_guard<std::mutex> lock(core_->mu);
    return f.inc_plus1 == peer_inc_ + 1 ? f.frames.load(std::memory_order_relaxed) : 0;
  }
  // A heartbeat never waits and never breaks the link: while the last one is
  // still on its way (the connection being set up, or a peer that is stopped
  // and not reading), no new one is sent. Skipped while an op sends on the
  // link: its messages show this process runs.
  void beat() override {
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock() || (failed() && !(retryable() && reopen()))) return;
    std::lock_guard<std::mutex> ucx(core_->ucx_mu);
    if (beating_ != nullptr) {
      const ucs_status_t st = ucp_request_check_status(beating_);
      if (st == UCS_INPROGRESS) return;
      ucp_request_free(beating_);
      beating_ = nullptr;
      if (st == UCS_OK) established_.store(true, std::memory_order_release);
    }
    beat_hdr_ = hdr_;
    beat_hdr_.type = kHeartbeat;
    ucp_request_param_t p{};
    ucs_status_ptr_t r = ucp_am_send_nbx(ep_, kAmId, &beat_hdr_, sizeof(beat_hdr_), nullptr, 0, &p);
    if (r == nullptr)
      established_.store(true, std::memory_order_release);
    else if (!UCS_PTR_IS_ERR(r))
      beating_ = r;
  }
  void farewell() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed()) return;
    try {
      send(kBye, 0, 0, 0, 0, writes_, nullptr, 0, Deadline::after_ms(100));
    } catch (const Error&) {
    }
  }

 private:
  void send_signal(FrameType type, size_t offset, uint64_t value, int bell,
                   const Deadline& deadline) {
    MC_ASSERT(offset + 8 <= peer_bytes_ && bell >= 0 && bell < kNumBells,
              "signal past the peer segment");
    std::lock_guard<std::mutex> lock(mu_);
    // The held writes travel with the signal (eager: they land in the same callback).
    send(type, static_cast<uint32_t>(bell), held_at_, offset, value, writes_, held_.data(),
         held_.size(), deadline, ucp_dt_make_contig(1), UCP_AM_SEND_FLAG_EAGER);
    held_.clear();
  }

  uint32_t write_flags() const { return core_->eager_writes ? UCP_AM_SEND_FLAG_EAGER : 0; }
  // Under mu_: sends the held writes on their own.
  void flush(const Deadline& deadline) {
    send(kWrite, 0, held_at_, 0, 0, ++writes_, held_.data(), held_.size(), deadline);
    held_.clear();
  }

  // Under mu_: sends one message and waits until UCX is done with `src`.
  void send(uint32_t type, uint32_t bell, uint64_t offset, uint64_t flag, uint64_t value,
            uint64_t seq, const void* src, size_t count, const Deadline& deadline,
            ucp_datatype_t dt = ucp_dt_make_contig(1), uint32_t flags = 0) {
    hdr_.type = type;
    hdr_.bell = bell;
    hdr_.offset = offset;
    hdr_.flag = flag;
    hdr_.value = value;
    hdr_.seq = seq;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_FLAGS;
    p.datatype = dt;
    p.flags = flags;
    for (;;) {
      if (failed() && !(retryable() && reopen()))
        throw_error(ErrorKind::kPeerFailed, peer_, "ucx link to rank ", peer_, " failed");
      // The header lives in hdr_ until the send is done (this waits for it).
      ucs_status_ptr_t r;
      {
        std::lock_guard<std::mutex> lock(core_->ucx_mu);
        r = ucp_am_send_nbx(ep_, kAmId, &hdr_, sizeof(hdr_), src, count, &p);
      }
      const ucs_status_t st = finish(r, deadline, "sending");
      if (st == UCS_OK) {
        established_.store(true, std::memory_order_release);
        return;
      }
      if (st == UCS_ERR_TIMED_OUT)
        throw_error(ErrorKind::kTimeout, peer_, "ucx send to rank ", peer_, " timed out");
      current_.load()->failed.store(true, std::memory_order_release);
      if (!retryable())
        throw_error(ErrorKind::kPeerFailed, peer_, "ucx send to rank ", peer_,
                    " failed: ", ucs_status_string(st));
      std::this_thread::sleep_for(std::chrono::milliseconds(10));  // then a new endpoint
    }
  }

  bool failed() const {
    return current_.load(std::memory_order_acquire)->failed.load(std::memory_order_acquire);
  }
  // Whether a failed endpoint may be replaced: nothing went through yet, the
  // link was not closed on purpose nor reported dead, and the connect window
  // is open.
  bool retryable() const {
    return !established_.load(std::memory_order_acquire) && !broken_ &&
           !given_up_.load(std::memory_order_acquire) && now_us() < retry_until_us_;
  }

  // Creates the endpoint (with a fresh error state).
  void open() {
    states_.push_back(std::make_unique<EpState>());
    states_.back()->core = core_;
    current_.store(states_.back().get(), std::memory_order_release);
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.address = reinterpret_cast<const ucp_address_t*>(remote_.data());
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = &on_ep_error;
    p.err_handler.arg = current_.load();
    ucs_status_t st;
    {
      std::lock_guard<std::mutex> lock(core_->ucx_mu);
      st = ucp_ep_create(core_->worker, &p, &ep_);
    }
    if (st != UCS_OK) {
      ep_ = nullptr;
      current_.load()->failed.store(true);
      throw_error(ErrorKind::kPeerFailed, peer_, "ucx: cannot reach rank ", peer_, ": ",
                  ucs_status_string(st));
    }
  }

  // Under mu_: replaces a failed endpoint that never carried a message.
  bool reopen() {
    MC_LOG(kDebug, "ucx: the endpoint to rank ", peer_, " failed before it was up; a new one");
    drop_endpoint();
    try {
      open();
    } catch (const Error&) {
      return false;
    }
    return true;
  }

  // Waits for request `r` to complete: progresses the worker, spinning
  // briefly, then sleeping longer and longer (up to 1 ms) so that ranks
  // sharing a core can run. Past `deadline` the endpoint is closed, which
  // ends the request (UCX must let go of the caller's buffer before this
  // returns), and the link is broken.
  ucs_status_t finish(ucs_status_ptr_t r, const Deadline& deadline, const char* what) {
    if (r == nullptr) return UCS_OK;
    if (UCS_PTR_IS_ERR(r)) return UCS_PTR_STATUS(r);
    const int64_t spin_until = now_us() + spin_budget_us();
    int64_t nap_us = 20;
    int64_t give_up_us = 0;  // once the endpoint is closed: a bound on the wait for UCX
    ucs_status_t st;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(core_->ucx_mu);
        st = ucp_request_check_status(r);
        if (st != UCS_INPROGRESS) {
          ucp_request_free(r);
          break;
        }
        if (ucp_worker_progress(core_->worker) != 0) continue;
      }
      if (give_up_us == 0 && deadline.expired()) {
        MC_LOG(kDebug, "ucx: ", what, " to rank ", peer_, " timed out; closing its endpoint");
        close();
        give_up_us = now_us() + 2000000;
      }
      if (give_up_us != 0 && now_us() > give_up_us) {
        MC_LOG(kWarn, "ucx: ", what, " to rank ", peer_, " did not end after its endpoint closed");
        return UCS_ERR_TIMED_OUT;  // the request is left to UCX
      }
      if (now_us() < spin_until) continue;
      std::this_thread::sleep_for(std::chrono::microseconds(nap_us));
      nap_us = std::min<int64_t>(nap_us * 2, 1000);
    }
    return give_up_us != 0 ? UCS_ERR_TIMED_OUT : st;
  }

  // Closes the endpoint at once (its requests end with an error) and breaks
  // the link for good.
  void close() {
    broken_ = true;
    drop_endpoint();
  }

  // Force-closes the endpoint; the close completes in the background
  // (closing_, finished by the destructor).
  void drop_endpoint() {
    current_.load()->failed.store(true, std::memory_order_release);
    if (ep_ == nullptr) return;
    if (beating_ != nullptr) {  // the close ends it; nobody looks at it again
      std::lock_guard<std::mutex> lock(core_->ucx_mu);
      ucp_request_free(beating_);
      beating_ = nullptr;
    }
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t c;
    {
      std::lock_guard<std::mutex> lock(core_->ucx_mu);
      c = ucp_ep_close_nbx(ep_, &p);
    }
    ep_ = nullptr;
    if (c != nullptr && !UCS_PTR_IS_ERR(c)) closing_.push_back(c);
  }

  std::shared_ptr<UcxWorker::Core> core_;
  const std::vector<uint8_t> remote_;  // the peer worker's address
  // One per endpoint this link opened (the last is current): a closed
  // endpoint's callback may still name its state.
  std::vector<std::unique_ptr<EpState> > states_;  // under mu_ (or construction)
  std::atomic<EpState*> current_{nullptr};
  ucp_ep_h ep_ = nullptr;
  std::vector<void*> closing_;
  std::atomic<bool> established_{false};  // a message went through
  bool broken_ = false;                   // closed on purpose (a send past its deadline)
  std::atomic<bool> given_up_{false};     // alive() said the peer is gone
  int peer_;
  uint32_t peer_inc_;
  uint64_t peer_bytes_;
  uint64_t link_;
  const int64_t retry_until_us_;
  std::mutex mu_;
  UcxHeader hdr_;
  UcxHeader beat_hdr_;       // the heartbeat's own: it may still be on its way
  void* beating_ = nullptr;  // that heartbeat's request
  uint64_t writes_ = 0;
  // Writes not sent yet (contiguous, from held_at_ in the peer's segment): the
  // next signal takes them along.
  static constexpr size_t kHoldBytes = 16 << 10;
  std::vector<uint8_t> held_;
  uint64_t held_at_ = 0;
};

}  // namespace

std::unique_ptr<PeerLink> UcxWorker::connect(const PeerAddress& addr, int my_rank,
                                             uint32_t my_inc) {
  return std::make_unique<UcxLink>(core_, addr, my_rank, my_inc);
}

}  // namespace mooncake

#endif  // MOONCAKE_HAVE_UCX
