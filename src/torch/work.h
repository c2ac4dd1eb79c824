// The c10d::Work that MooncakeBackend hands back for each op: a view of the
// core's Request, with torch's future completed when the request is. The
// future is made on the first getFuture(): most callers only wait, and making
// it for every op cost a tenth of a small op's time. It also says which peers
// failed during the op (pg.get_failed_ranks_hint, pg.get_local_success).
#pragma once

#include <memory>
#include <mutex>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "collectives/request.h"

namespace mooncake {

// The ranks that failed during one op, written by the op's task before its
// request completes (a p2p op records none: its error names the peer).
using FailedRanks = std::shared_ptr<std::vector<int>>;

class MooncakeWork : public c10d::Work {
 public:
  // `queue`, when given, is the queue the request runs on: wait() then helps run it.
  // `slots`: the group's max_world_size (the hint's length); `failed`: the
  // records of the op's parts (one, or a coalesced block's).
  MooncakeWork(int rank, c10d::OpType type, std::shared_ptr<Request> request,
               std::vector<at::Tensor> outputs, std::weak_ptr<OpQueue> queue = {}, int slots = 0,
               std::vector<FailedRanks> failed = {});

  bool isCompleted() override { return request_->done(); }
  bool isSuccess() const override { return request_->done() && !request_->error(); }
  std::exception_ptr exception() const override { return request_->error(); }
  int sourceRank() const override { return request_->source_rank(); }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  bool wait(std::chrono::milliseconds timeout) override;
  void synchronize() override {}
  const std::shared_ptr<Request>& request() const { return request_; }

  // int32 [slots] on the CPU: 1 where that rank failed during this op (left
  // out by an agreement, or the peer the op failed on). Waits for the op to
  // end first (bounded by its own deadline); the same tensor on every call.
  at::Tensor failed_ranks_hint();
  // The op ended without an error and no peer failed during it.
  bool local_success();
  const std::vector<FailedRanks>& failed_records() const { return failed_; }

 private:
  void await_end();

  std::shared_ptr<Request> request_;
  std::vector<at::Tensor> outputs_;
  std::mutex future_mu_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // under future_mu_
  at::Tensor hint_;                                 // under future_mu_
  std::weak_ptr<OpQueue> queue_;
  int slots_;
  std::vector<FailedRanks> failed_;
};

// A Work that wraps a MooncakeWork (the CUDA backend's): the hint is that one's.
class WrapsMooncakeWork {
 public:
  virtual ~WrapsMooncakeWork() = default;
  virtual MooncakeWork& mooncake_work() const = 0;
};

// pg.get_failed_ranks_hint / pg.get_local_success for any Work: another
// backend's gets upstream's answers (an empty tensor, False).
at::Tensor failed_ranks_hint(c10d::Work& work);
bool local_success(c10d::Work& work);

}  // namespace mooncake
