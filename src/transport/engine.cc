#include "transport/engine.h"

#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <fstream>
#include <sstream>

#include "core/env.h"
#include "core/error.h"
#include "core/host.h"
#include "core/limits.h"
#include "core/log.h"
#include "core/record.h"
#include "core/thread.h"
#include "core/wait.h"
#include "transport/shm.h"
#include "transport/ucx.h"

namespace mooncake {

namespace {

std::string default_host() {
  char name[256] = {0};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "127.0.0.1";
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* res = nullptr;
  if (::getaddrinfo(name, nullptr, &hints, &res) != 0 || res == nullptr) return "127.0.0.1";
  char host[64] = {0};
  ::getnameinfo(res->ai_addr, res->ai_addrlen, host, sizeof(host), nullptr, 0, NI_NUMERICHOST);
  ::freeaddrinfo(res);
  return host;
}

}  // namespace

const std::string& local_host_key() {
  static const std::string key = boot_id() + "|" + net_namespace() + "|" + pid_namespace();
  return key;
}

std::string PeerAddress::encode() const {
  std::ostringstream os;
  os << rank << '\n'
     << incarnation << '\n'
     << host_key << '\n'
     << pid << '\n'
     << segment_fd << '\n'
     << segment_bytes << '\n'
     << tcp_host << '\n'
     << ucx_address << '\n'
     << tcp_port << '\n';
  return os.str();
}

PeerAddress PeerAddress::decode(const std::string& text, const std::string& where) {
  RecordReader in(text, "peer address" + where);
  PeerAddress a;
  a.rank = in.number<int>("rank", 0, kMaxCapacity - 1);
  a.incarnation = in.number<uint32_t>("incarnation");
  a.host_key = in.word("host_key", 512);
  a.pid = in.number<int>("pid", 1);
  a.segment_fd = in.number<int>("segment_fd", -1);
  a.segment_bytes = in.number<uint64_t>("segment_bytes", kSegmentHeaderBytes);
  a.tcp_host = in.word("tcp_host", 255);
  a.ucx_address = in.word("ucx_address", kMaxUcxAddressHex);
  a.tcp_port = in.number<int>("tcp_port", 1, 65535);
  in.end();
  return a;
}

EngineOptions EngineOptions::from_env() {
  EngineOptions o;
  std::string t = env_string("MOONCAKE_TRANSPORT");
  MC_CHECK_ARG(t == "auto" || t == "tcp" || t == "shm" || t == "ucx",
               "MOONCAKE_TRANSPORT must be auto, shm, tcp or ucx, got '", t, "'");
  o.force_tcp = t == "tcp";
  o.force_ucx = t == "ucx";
  o.host_ip = env_string("MOONCAKE_HOST_IP");
  return o;
}

std::vector<std::string> TransferEngine::available_transports() {
  if (ucx_built()) return {"shm", "tcp", "ucx"};
  return {"shm", "tcp"};
}

bool EngineOptions::wants_ucx() const {
  if (force_tcp) return false;
  if (force_ucx) {
    MC_CHECK_ARG(ucx_built(),
                 "MOONCAKE_TRANSPORT=ucx: the ucx transport is not in this build (libucx-dev was "
                 "missing when it was built)");
    return true;
  }
  return ucx_built() && !rdma_devices().empty();
}

namespace {
constexpr int64_t kHeartbeatPeriodMs = 20;
// A gap in the heartbeat thread's own rounds past this means this process was
// stopped or starved.
constexpr int64_t kStallUs = 10 * kHeartbeatPeriodMs * 1000;
}  // namespace

Endpoint::Endpoint(const TransferEngine& engine, Store& store, std::string prefix, int rank,
                   uint32_t incarnation, int capacity, size_t segment_bytes)
    : options_(engine.options()),
      store_(store),
      prefix_(std::move(prefix)),
      rank_(rank),
      incarnation_(incarnation),
      capacity_(capacity),
      segment_(segment_bytes),
      links_(static_cast<size_t>(capacity)),
      on_host_(static_cast<size_t>(capacity), 0),
      pulse_(new Pulse[static_cast<size_t>(capacity)]),
      last_round_us_(now_us()) {
  for (int p = 0; p < capacity; ++p) pulse_[p].changed_us.store(now_us());
  MC_CHECK_ARG(rank >= 0 && rank < capacity, "rank must be in [0, ", capacity, "), got ", rank);
  // The group's secret: the first member's token wins; every member reads it.
  secret_ = store_.compare_set(prefix_ + "secret", random_secret());
  check_secret(secret_, "the store holds a malformed group secret under '" + prefix_ + "secret'");
  receiver_ = std::make_unique<TcpReceiver>(segment_, capacity, rank, incarnation, options_.host_ip,
                                            secret_, &alarms_);
  if (options_.wants_ucx())
    ucx_ =
        std::make_unique<UcxWorker>(segment_, capacity, secret_, options_.device_filter, &alarms_);
  stop_fd_ = MC_SYSCHECK(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  links_[rank] = self_link(segment_);
  heartbeat_ = std::thread([this] {
    begin_library_thread("mc-heartbeat");
    heartbeat_loop();
  });
  PeerAddress me;
  me.rank = rank;
  me.incarnation = incarnation;
  me.host_key = local_host_key();
  me.pid = static_cast<int>(::getpid());
  me.segment_fd = segment_.fd();
  me.segment_bytes = segment_bytes;
  me.tcp_host = options_.host_ip.empty() ? default_host() : options_.host_ip;
  me.tcp_port = receiver_->port();
  if (ucx_) me.ucx_address = ucx_->address();
  shm_seal(segment_, me, secret_);
  store_.set(address_key(prefix_, rank, incarnation), me.encode());
}

std::string address_key(const std::string& prefix, int rank, uint32_t inc) {
  return prefix + "addr/" + std::to_string(rank) + "/" + std::to_string(inc);
}

void Endpoint::connect_all(int size, const Deadline& deadline) {
  for (int peer = 0; peer < size; ++peer)
    if (peer != rank_) connect(peer, 0, deadline);
  store_.set(prefix_ + "connected/" + std::to_string(rank_), "1");
  for (int peer = 0; peer < size; ++peer)
    store_.get(prefix_ + "connected/" + std::to_string(peer), deadline.remaining_ms(1L << 40));
}

void Endpoint::connect(int peer, uint32_t inc, const Deadline& deadline) {
  MC_CHECK_ARG(peer >= 0 && peer < capacity_ && peer != rank_,
               "connect: peer must be another slot in [0, ", capacity_, "), got ", peer);
  const std::string key = address_key(prefix_, peer, inc);
  PeerAddress addr =
      PeerAddress::decode(store_.get(key, deadline.remaining_ms(1L << 40)), " under '" + key + "'");
  if (addr.rank != peer || addr.incarnation != inc)
    throw_error(ErrorKind::kInternal, peer, "malformed peer address under '", key,
                "' in the store: it names rank ", addr.rank, " incarnation ", addr.incarnation);
  MC_CHECK_ARG(addr.segment_bytes == segment_.size(), "rank ", peer, " uses a ", addr.segment_bytes,
               "-byte segment but rank ", rank_, " uses ", segment_.size(),
               ": the group's capacity (max_world_size) or MOONCAKE_CHUNK_BYTES differs between "
               "ranks");
  // shm on this host unless a network transport is forced; then ucx where
  // both ends run a worker; else tcp.
  std::shared_ptr<PeerLink> link;
  if (!options_.force_tcp && !options_.force_ucx && shm_can_reach(addr))
    link = shm_connect(addr, secret_);
  else if (ucx_ && addr.ucx_address != "-") {
    // Reach the peer first (its tcp receiver answers as that process), within
    // the deadline: UCX 1.13's tcp transport connects in blocking mode inside
    // ucp_ep_create, so a peer whose host is gone would hold this thread (and
    // a lock UCX's own threads need) for the kernel's retries, minutes.
    tcp_probe(addr, rank_, incarnation_, secret_, deadline);
    link = ucx_->connect(addr, rank_, incarnation_);
  } else {
    link = tcp_connect(addr, rank_, incarnation_, secret_, *receiver_, deadline);
  }
  std::lock_guard<std::mutex> lock(mu_);
  links_[peer] = std::move(link);
  pulse_[peer].last.store(0);
  pulse_[peer].changed_us.store(now_us());
  // Whatever the transport: waits stop spinning once this host runs more
  // ranks than CPUs (core/wait.h).
  on_host_[static_cast<size_t>(peer)] = addr.host_key == local_host_key();
  note_ranks_on_host(1 + static_cast<int>(std::count(on_host_.begin(), on_host_.end(), 1)));
}

void Endpoint::disconnect(int peer, bool farewell) {
  std::shared_ptr<PeerLink> old;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (peer != rank_) old.swap(links_[peer]);
  }
  if (old && farewell) old->farewell();
}

std::shared_ptr<PeerLink> Endpoint::link(int peer) const {
  std::lock_guard<std::mutex> lock(mu_);
  return links_[peer];
}

bool Endpoint::alive(int peer) const {
  auto l = link(peer);
  return l != nullptr && l->alive();
}

uint64_t Endpoint::heartbeat(int peer) const {
  auto l = link(peer);
  return l != nullptr ? l->heartbeat() : 0;
}

int64_t Endpoint::silent_ms(int peer) const {
  auto l = link(peer);
  if (!l) return 0;
  const int64_t now = now_us();
  // Judged from fresh readings, so that a starved heartbeat thread (this
  // whole process descheduled for a while) never makes a live peer look
  // silent: a heartbeat that moved since the thread last looked is life, and
  // while the thread itself lags, nobody's silence can be told.
  if (now - last_round_us_.load(std::memory_order_acquire) > kStallUs) return 0;
  if (l->heartbeat() != pulse_[peer].last.load(std::memory_order_relaxed)) return 0;
  return (now - pulse_[peer].changed_us.load(std::memory_order_relaxed)) / 1000;
}

const char* Endpoint::transport_of(int peer) const {
  MC_CHECK_ARG(peer >= 0 && peer < capacity_, "transport_of: peer must be in [0, ", capacity_,
               "), got ", peer);
  auto l = link(peer);
  return l != nullptr ? l->transport() : "none";
}

uint64_t Endpoint::hint(int slot) const {
  MC_ASSERT(slot >= 0 && slot < kNumHints, "hint slot ", slot);
  return reinterpret_cast<const SegmentHeader*>(segment_.base())
      ->hints[slot]
      .load(std::memory_order_acquire);
}

void Endpoint::post_hint(int peer, int slot, uint64_t value) {
  MC_ASSERT(slot >= 0 && slot < kNumHints, "hint slot ", slot);
  auto l = link(peer);
  if (!l) return;
  try {
    for (int bell = 0; bell < kNumBells; ++bell)
      l->signal_max(hint_offset(slot), value, bell, Deadline::after_ms(100));
  } catch (const Error&) {
    // A peer that cannot take it is gone or going: nothing to tell.
  }
}

void Endpoint::wake_all() {
  for (int b = 0; b < kNumBells; ++b) ring(segment_.bell(b));
}

void Endpoint::heartbeat_loop() {
  auto* header = reinterpret_cast<SegmentHeader*>(segment_.base());
  // Peers learn this process died from the word the moment this thread dies.
  life_.hold(&header->life);
  std::vector<std::shared_ptr<PeerLink>> links;
  std::vector<std::weak_ptr<PeerLink>> seen_dead;  // links already reported gone
  std::vector<pollfd> fds;
  std::vector<std::atomic<uint32_t>*> lives;  // the watched peers' life words
  std::vector<int> gone, dead;                // slots newly seen gone, and all seen gone
  std::vector<int64_t> still_us;              // per slot: how long its heartbeat stood still
  int64_t last_round = now_us();
  // The last wait: when it began and ended, and how (for the debug log of a death).
  int64_t wait_began = 0, wait_ended = 0;
  LifeWake woke = LifeWake::kSkipped;
  bool waited_on_words = false;
  for (;;) {
    header->heartbeat.fetch_add(1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> l(mu_);
      links = links_;
    }
    const int64_t now = now_us();
    // After a long gap in our own rounds (this process was stopped or starved)
    // no peer's silence can be told apart from ours: start everyone afresh.
    const bool we_stalled = now - last_round > kStallUs;
    last_round = now;
    fds.assign(1, pollfd{stop_fd_, POLLIN, 0});
    lives.clear();
    bool newly_dead = false;
    gone.clear();
    dead.clear();
    still_us.assign(links.size(), 0);
    for (size_t p = 0; p < links.size(); ++p) {
      PeerLink* link = links[p].get();
      if (!link) continue;
      const auto& shared = links[p];
      link->beat();
      const uint64_t hb = link->heartbeat();
      if (hb != pulse_[p].last.load(std::memory_order_relaxed) || we_stalled) {
        pulse_[p].changed_us.store(now, std::memory_order_relaxed);
        pulse_[p].last.store(hb, std::memory_order_relaxed);
      }
      if (static_cast<int>(p) != rank_)
        still_us[p] = now - pulse_[p].changed_us.load(std::memory_order_relaxed);
      const bool known = std::any_of(seen_dead.begin(), seen_dead.end(),
                                     [&](const auto& d) { return d.lock() == shared; });
      if (known) {
        dead.push_back(static_cast<int>(p));
        continue;
      }
      if (!link->alive()) {
        seen_dead.push_back(shared);
        newly_dead = true;
        gone.push_back(static_cast<int>(p));
        dead.push_back(static_cast<int>(p));
      } else {
        if (link->death_fd() >= 0) fds.push_back(pollfd{link->death_fd(), POLLIN, 0});
        if (auto* word = link->life_word()) lives.push_back(word);
      }
    }
    last_round_us_.store(now, std::memory_order_release);  // after the samples it vouches for
    // Forget links that were dropped, so the list stays small.
    std::erase_if(seen_dead, [](const auto& d) { return d.expired(); });
    if (newly_dead) {
      alarms_.fetch_add(1, std::memory_order_acq_rel);
      wake_all();
    }
    tell_watchers(gone, dead, still_us);
    // Where the time from a death to its notice went (MOONCAKE_LOG_LEVEL=debug), once
    // the watchers know: a write to stderr must not delay them.
    for (int p : gone)
      MC_LOG(kDebug, "rank ", rank_, " heartbeat: rank ", p, " seen gone at ", now,
             " us; the last wait (", waited_on_words ? "on the life words" : "on the pidfds",
             ") began at ", wait_began, " and ended at ", wait_ended, waited_on_words ? ", " : "",
             waited_on_words ? life_wake_name(woke) : "");
    // Sleep until the next round, a peer's death, or stop: on the peers' life
    // words where the kernel can wait on several futexes (their pidfds are
    // looked at every round), else on the pidfds.
    // `links` keeps the peers' mappings (and pidfds) open while it sleeps on them.
    wait_began = now_us();
    const bool waited = life_wait(lives, &stop_word_, kHeartbeatPeriodMs, &woke);
    waited_on_words = waited;
    const bool stop =
        waited ? stop_word_.load() != 0
               : ::poll(fds.data(), fds.size(), static_cast<int>(kHeartbeatPeriodMs)) > 0 &&
                     (fds[0].revents & POLLIN);
    wait_ended = now_us();
    links.clear();
    if (stop) break;
  }
  life_.release();
}

uint64_t Endpoint::watch_peers(LossListener fn, int64_t hang_ms) {
  std::lock_guard<std::mutex> l(watch_mu_);
  const uint64_t id = next_watch_++;
  watchers_.push_back(Watcher{id, std::move(fn), hang_ms > 0 ? hang_ms * 1000 : 0,
                              std::vector<uint8_t>(static_cast<size_t>(capacity_), 0)});
  return id;
}

void Endpoint::unwatch_peers(uint64_t id) {
  std::lock_guard<std::mutex> l(watch_mu_);
  std::erase_if(watchers_, [id](const Watcher& w) { return w.id == id; });
}

void Endpoint::tell_watchers(const std::vector<int>& gone, const std::vector<int>& dead,
                             const std::vector<int64_t>& still_us) {
  std::lock_guard<std::mutex> l(watch_mu_);
  // told[p]: 0 nothing told; 1 told silent; 2 told gone (for good, while the link lasts).
  std::erase_if(watchers_, [&](Watcher& w) {
    bool keep = true;
    auto tell = [&](int p, PeerLoss why, uint8_t state) {
      if (keep) keep = w.fn(p, why);
      w.told[p] = state;
    };
    for (int p : w.fresh ? dead : gone)
      if (w.told[p] != 2) tell(p, PeerLoss::kGone, 2);
    w.fresh = false;
    for (size_t p = 0; p < still_us.size(); ++p) {
      const int peer = static_cast<int>(p);
      if (std::find(dead.begin(), dead.end(), peer) != dead.end()) continue;
      if (still_us[p] == 0) {  // it moved (or a new link)
        if (w.told[p] == 1) tell(peer, PeerLoss::kBack, 0);
        w.told[p] = 0;
      } else if (w.hang_us > 0 && still_us[p] >= w.hang_us && w.told[p] == 0) {
        tell(peer, PeerLoss::kSilent, 1);
      }
    }
    return !keep;
  });
}

Endpoint::~Endpoint() {
  // Before the heartbeat thread lets go of the life word: peers that see the
  // word let go find the segment closed, and take this endpoint for gone.
  reinterpret_cast<SegmentHeader*>(segment_.base())->closed.store(1, std::memory_order_release);
  uint64_t one = 1;
  life_stop(&stop_word_);
  if (::write(stop_fd_, &one, sizeof(one)) < 0) { /* the thread also stops on close */
  }
  if (heartbeat_.joinable()) heartbeat_.join();
  ::close(stop_fd_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    links_.clear();
  }
  ucx_.reset();
  receiver_.reset();
}

}  // namespace mooncake
