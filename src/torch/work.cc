#include "torch/work.h"

#include "core/error.h"

namespace mooncake {

MooncakeWork::MooncakeWork(int rank, c10d::OpType type, std::shared_ptr<Request> request,
                           std::vector<at::Tensor> outputs, std::weak_ptr<OpQueue> queue)
    : Work(rank, type),
      request_(std::move(request)),
      outputs_(std::move(outputs)),
      queue_(std::move(queue)) {}

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

}  // namespace mooncake
