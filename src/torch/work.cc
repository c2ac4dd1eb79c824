#include "torch/work.h"

#include "core/error.h"

namespace mooncake {

MooncakeWork::MooncakeWork(int rank, c10d::OpType type, std::shared_ptr<Request> request,
                           std::vector<at::Tensor> outputs, std::weak_ptr<OpQueue> queue, int slots,
                           std::vector<FailedRanks> failed)
    : Work(rank, type),
      request_(std::move(request)),
      outputs_(std::move(outputs)),
      queue_(std::move(queue)),
      slots_(slots),
      failed_(std::move(failed)) {}

c10::intrusive_ptr<c10::ivalue::Future> MooncakeWork::getFuture() {
  std::lock_guard<std::mutex> lock(future_mu_);
  if (!future_) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(
        c10::ListType::create(c10::TensorType::get()), std::vector<c10::Device>{});
    // Runs at once when the request is already done.
    request_->on_complete([future = future_, outputs = outputs_](std::exception_ptr error) {
      if (error)
        future->setError(error);
      else
        future->markCompleted(c10::IValue(outputs));
    });
  }
  return future_;
}

bool MooncakeWork::wait(std::chrono::milliseconds timeout) {
  int64_t ms = timeout == kNoTimeout ? -1 : timeout.count();
  auto queue = queue_.lock();
  bool done = queue ? queue->wait(request_, ms) : request_->wait(ms);
  if (!done)
    throw_error(ErrorKind::kTimeout, -1, "Work.wait: the operation did not finish within ", ms,
                " ms");
  if (auto error = request_->error()) std::rethrow_exception(error);
  return true;
}

void MooncakeWork::await_end() {
  // Every op has a deadline of its own, so this ends.
  auto queue = queue_.lock();
  if (queue)
    queue->wait(request_, -1);
  else
    request_->wait(-1);
}

at::Tensor MooncakeWork::failed_ranks_hint() {
  await_end();
  std::lock_guard<std::mutex> lock(future_mu_);
  if (hint_.defined()) return hint_;
  hint_ = at::zeros({slots_}, at::TensorOptions().dtype(at::kInt));
  auto mark = [&](int peer) {
    if (peer >= 0 && peer < slots_ && peer != rank_) hint_.data_ptr<int32_t>()[peer] = 1;
  };
  for (const FailedRanks& part : failed_)
    if (part)
      for (int p : *part) mark(p);
  // A p2p op records nothing: its error names the peer.
  if (auto error = request_->error()) {
    try {
      std::rethrow_exception(error);
    } catch (const Error& e) {
      if (e.peer_or_timeout()) mark(e.peer());
    } catch (...) {
    }
  }
  return hint_;
}

bool MooncakeWork::local_success() {
  const at::Tensor hint = failed_ranks_hint();
  return !request_->error() && hint.eq(0).all().item<bool>();
}

at::Tensor failed_ranks_hint(c10d::Work& work) {
  if (auto* w = dynamic_cast<MooncakeWork*>(&work)) return w->failed_ranks_hint();
  if (auto* w = dynamic_cast<WrapsMooncakeWork*>(&work))
    return w->mooncake_work().failed_ranks_hint();
  return at::Tensor();
}

bool local_success(c10d::Work& work) {
  if (auto* w = dynamic_cast<MooncakeWork*>(&work)) return w->local_success();
  if (auto* w = dynamic_cast<WrapsMooncakeWork*>(&work)) return w->mooncake_work().local_success();
  return false;
}

}  // namespace mooncake
