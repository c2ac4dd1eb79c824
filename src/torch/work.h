// The c10d::Work that MooncakeBackend hands back for each op: a view of the
// core's Request, with torch's future completed when the request is. The
// future is made on the first getFuture(): most callers only wait, and making
// it for every op cost a tenth of a small op's time.
#pragma once

#include <memory>
#include <mutex>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "collectives/request.h"

namespace mooncake {

class MooncakeWork : public c10d::Work {
 public:
  // `queue`, when given, is the queue the request runs on: wait() then helps run it.
  MooncakeWork(int rank, c10d::OpType type, std::shared_ptr<Request> request,
               std::vector<at::Tensor> outputs, std::weak_ptr<OpQueue> queue = {});

  bool isCompleted() override { return request_->done(); }
  bool isSuccess() const override { return request_->done() && !request_->error(); }
  std::exception_ptr exception() const override { return request_->error(); }
  int sourceRank() const override { return request_->source_rank(); }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  bool wait(std::chrono::milliseconds timeout) override;
  void synchronize() override {}
  const std::shared_ptr<Request>& request() const { return request_; }

 private:
  std::shared_ptr<Request> request_;
  std::vector<at::Tensor> outputs_;
  std::mutex future_mu_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // under future_mu_
  std::weak_ptr<OpQueue> queue_;
};

}  // namespace mooncake
