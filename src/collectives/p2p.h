// Point-to-point messages with tags and receive-from-any-source.
//
// Sends run on their own thread, so `send` never blocks its caller. A progress
// thread drains every peer's p2p channel as messages arrive: a message that
// matches a posted receive lands straight in its buffer; one that does not yet
// is kept in arrival order until a receive claims it. Messages from one
// source with one tag match receives in order.
#pragma once

#include <atomic>
#include <list>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "collectives/channel.h"
#include "collectives/request.h"

namespace mooncake {

class P2P {
 public:
  P2P(Channels& channels, int rank, int size, int64_t default_timeout_ms);
  ~P2P();

  // timeout_ms < 0: the default.
  std::shared_ptr<Request> send(const void* data, size_t bytes, int dst, uint64_t tag,
                                int64_t timeout_ms = -1);
  // src < 0: any source; the request's source_rank() tells which.
  std::shared_ptr<Request> recv(void* data, size_t bytes, int src, uint64_t tag,
                                int64_t timeout_ms = -1);
  void stop();

 private:
  struct Posted;
  struct Incoming;
  void progress_loop();
  void on_message(int src, const MsgHeader* msg);
  void housekeeping();
  void finish(const std::shared_ptr<Incoming>& in);

  Channels& ch_;
  int rank_;
  int size_;
  int64_t default_timeout_ms_;
  OpQueue sender_{0};  // sends start at once: their callers rarely wait right away
  std::mutex mu_;
  std::list<std::shared_ptr<Posted>> posted_;
  std::list<std::shared_ptr<Incoming>> unexpected_;
  std::vector<std::shared_ptr<Incoming>> in_flight_;  // per source
  std::atomic<bool> stopping_{false};
  std::thread progress_;
};

}  // namespace mooncake
