// MooncakeBackend's point-to-point ops (send, recv, recv from any source):
// posted on the P2P channels from the caller's thread, not through the
// collectives' queue; inside a batch_isend_irecv block, at endCoalescing.
#include "torch/backend.h"
#include "torch/tensor_args.h"

namespace mooncake {

P2P& MooncakeBackend::p2p() {
  std::lock_guard<std::mutex> lock(p2p_mu_);
  MC_CHECK_ARG(comm_ != nullptr, getBackendName(), ": the process group was shut down");
  if (!p2p_)
    p2p_ = std::make_unique<P2P>(comm_->p2p_channels(), rank_, comm_->capacity(), p2p_timeout_ms());
  return *p2p_;
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::send(std::vector<at::Tensor>& tensors, int dst,
                                                     int tag) {
  return p2p_op(
      c10d::OpType::SEND, {tensors.empty() ? at::Tensor() : tensors[0]},
      [&]() -> Post {
        check_count(tensors.size(), 1, "send", "tensors");
        check_tensor(tensors[0], "send", "tensor");
        check_rank(dst, static_cast<int>(extended_size_), "send", "dst");
        at::Tensor t = tensors[0].contiguous();
        return [this, t, dst, tag] {
          auto request = p2p().send(t.data_ptr(), t.nbytes(), dst, static_cast<uint64_t>(tag));
          request->on_complete([t](std::exception_ptr) {});  // keeps the tensor alive until sent
          return request;
        };
      },
      /*send=*/true);
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::recv(std::vector<at::Tensor>& tensors, int src,
                                                     int tag) {
  return p2p_op(c10d::OpType::RECV, {tensors.empty() ? at::Tensor() : tensors[0]}, [&]() -> Post {
    check_count(tensors.size(), 1, "recv", "tensors");
    check_tensor(tensors[0], "recv", "tensor");
    check_rank(src, static_cast<int>(extended_size_), "recv", "src", /*allow_any=*/true);
    at::Tensor user = tensors[0];
    at::Tensor buf = user.is_contiguous() ? user : user.contiguous();
    return [this, user, buf, src, tag] {
      auto request = p2p().recv(buf.data_ptr(), buf.nbytes(), src, static_cast<uint64_t>(tag));
      auto done = std::make_shared<Request>();
      request->on_complete([user, buf, request, done](std::exception_ptr e) {
        if (!e && !buf.is_same(user)) user.copy_(buf);
        done->set_source_rank(request->source_rank());
        done->complete(e);
      });
      return done;
    };
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::p2p_op(c10d::OpType type,
                                                       std::vector<at::Tensor> outputs,
                                                       const std::function<Post()>& check,
                                                       bool send) {
  if (!coalescing_) {
    const Post post = check();
    // A send's Work waits through the sends' queue: a blocking send (its wait
    // at once) then runs on the caller's thread, one thread hop fewer a message.
    // (Taken before posting: a shutdown in between fails the call, not a posted send.)
    const std::weak_ptr<OpQueue> queue = send ? p2p().send_queue() : std::weak_ptr<OpQueue>();
    return wrap(post(), type, std::move(outputs), queue);
  }
  auto done = std::make_shared<Request>();
  try {
    deferred_.push_back({check(), done});
  } catch (const Error&) {
    if (!batch_error_) batch_error_ = std::current_exception();
    done->complete(std::current_exception());
  }
  return wrap(done, type, std::move(outputs));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                              int tag) {
  return recv(tensors, -1, tag);
}

}  // namespace mooncake
