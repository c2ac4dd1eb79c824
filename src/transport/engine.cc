#include "transport/engine.h"

#include <netdb.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "core/env.h"
#include "core/error.h"
#include "transport/shm.h"

namespace mooncake {

namespace {

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string ns_id(const char* path) {
  char buf[128];
  ssize_t n = ::readlink(path, buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string("?");
}

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
  static const std::string key = read_first_line("/proc/sys/kernel/random/boot_id") + "|" +
                                 ns_id("/proc/self/ns/net") + "|" + ns_id("/proc/self/ns/pid");
  return key;
}

std::string PeerAddress::encode() const {
  std::ostringstream os;
  os << rank << '\n'
     << host_key << '\n'
     << pid << '\n'
     << segment_fd << '\n'
     << segment_bytes << '\n'
     << tcp_host << '\n'
     << tcp_port << '\n';
  return os.str();
}

PeerAddress PeerAddress::decode(const std::string& text) {
  try {
    return decode_fields(text);
  } catch (const std::logic_error& e) {  // std::stoi and friends
    throw_error(ErrorKind::kInternal, -1, "malformed peer address in the store: ", e.what());
  }
}

PeerAddress PeerAddress::decode_fields(const std::string& text) {
  std::istringstream is(text);
  PeerAddress a;
  std::string line;
  auto next = [&]() {
    MC_ASSERT(static_cast<bool>(std::getline(is, line)), "malformed peer address");
    return line;
  };
  a.rank = std::stoi(next());
  a.host_key = next();
  a.pid = std::stoi(next());
  a.segment_fd = std::stoi(next());
  a.segment_bytes = std::stoull(next());
  a.tcp_host = next();
  a.tcp_port = std::stoi(next());
  return a;
}

EngineOptions EngineOptions::from_env() {
  EngineOptions o;
  std::string t = env_string("MOONCAKE_TRANSPORT");
  MC_CHECK_ARG(t == "auto" || t == "tcp" || t == "shm",
               "MOONCAKE_TRANSPORT must be auto, shm or tcp, got '", t, "'");
  o.force_tcp = t == "tcp";
  o.host_ip = env_string("MOONCAKE_HOST_IP");
  return o;
}

std::vector<std::string> TransferEngine::available_transports() {
  return {"shm", "tcp"};
}

Endpoint::Endpoint(const TransferEngine& engine, Store& store, const std::string& prefix, int rank,
                   int size, size_t segment_bytes, const Deadline& deadline)
    : rank_(rank), size_(size), segment_(segment_bytes) {
  const EngineOptions& opts = engine.options();
  receiver_ = std::make_unique<TcpReceiver>(segment_, size, opts.host_ip);
  PeerAddress me;
  me.rank = rank;
  me.host_key = local_host_key();
  me.pid = static_cast<int>(::getpid());
  me.segment_fd = segment_.fd();
  me.segment_bytes = segment_bytes;
  me.tcp_host = opts.host_ip.empty() ? default_host() : opts.host_ip;
  me.tcp_port = receiver_->port();
  store.set(prefix + "addr/" + std::to_string(rank), me.encode());

  links_.resize(static_cast<size_t>(size));
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) {
      links_[peer] = self_link(segment_);
      continue;
    }
    PeerAddress addr = PeerAddress::decode(
        store.get(prefix + "addr/" + std::to_string(peer), deadline.remaining_ms(1L << 40)));
    MC_CHECK_ARG(addr.segment_bytes == segment_bytes, "rank ", peer, " uses a ", addr.segment_bytes,
                 "-byte segment but rank ", rank, " uses ", segment_bytes,
                 ": the group's size or MOONCAKE_CHUNK_BYTES differs between ranks");
    if (!opts.force_tcp && shm_can_reach(addr))
      links_[peer] = shm_connect(addr);
    else
      links_[peer] = tcp_connect(addr, rank, *receiver_, deadline);
  }
  store.set(prefix + "connected/" + std::to_string(rank), "1");
  for (int peer = 0; peer < size; ++peer)
    store.get(prefix + "connected/" + std::to_string(peer), deadline.remaining_ms(1L << 40));
}

Endpoint::~Endpoint() {
  links_.clear();
  receiver_.reset();
}

}  // namespace mooncake
