// MooncakeBackend's collectives that reduce (all_reduce, reduce,
// reduce_scatter and their coalesced forms): each checks its arguments on the
// caller's thread and queues the core's op (see collective() and enqueue() in
// backend.h).
#include <tuple>

#include "torch/backend.h"
#include "torch/tensor_args.h"

namespace mooncake {

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  return collective([&] {
    check_count(tensors.size(), 1, "all_reduce", "tensors");
    check_tensor(tensors[0], "all_reduce", "tensor");
    at::Tensor t = tensors[0];
    DType dt = to_dtype(t.scalar_type(), "all_reduce", "tensor");
    RedOp op = to_redop(opts.reduceOp, t, "all_reduce");
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(
        c10d::OpType::ALLREDUCE,
        [this, t, dt, op, timeout] {
          OutBuf out(t);
          comm_->all_reduce(out.ptr(), elems(t), dt, op, timeout);
          out.commit();
        },
        {t}, !opts.asyncOp);
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  return collective([&] {
    std::vector<std::tuple<at::Tensor, DType, RedOp>> items;
    for (auto& t : tensors) {
      check_tensor(t, "all_reduce_coalesced", "tensors");
      items.emplace_back(t, to_dtype(t.scalar_type(), "all_reduce_coalesced", "tensors"),
                         to_redop(opts.reduceOp, t, "all_reduce_coalesced"));
    }
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(
        c10d::OpType::ALLREDUCE_COALESCED,
        [this, items, timeout] {
          for (auto& [t, dt, op] : items) {
            OutBuf out(t);
            comm_->all_reduce(out.ptr(), elems(t), dt, op, timeout);
            out.commit();
          }
        },
        tensors, !opts.asyncOp);
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  return collective([&] {
    check_count(tensors.size(), 1, "reduce", "tensors");
    check_tensor(tensors[0], "reduce", "tensor");
    check_rank(opts.rootRank, static_cast<int>(extended_size_), "reduce", "dst");
    at::Tensor t = tensors[0];
    DType dt = to_dtype(t.scalar_type(), "reduce", "tensor");
    RedOp op = to_redop(opts.reduceOp, t, "reduce");
    int root = static_cast<int>(opts.rootRank);
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(
        c10d::OpType::REDUCE,
        [this, t, dt, op, root, timeout] {
          OutBuf out(t);
          comm_->reduce(out.ptr(), elems(t), dt, op, root, timeout);
          if (rank_ == root) out.commit();
        },
        {t}, !opts.asyncOp);
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return collective([&] {
    check_count(outputs.size(), 1, "reduce_scatter", "output tensors");
    check_count(inputs.size(), 1, "reduce_scatter", "input tensor lists");
    const int width = list_width(inputs[0].size(), "reduce_scatter", "input_list");
    at::Tensor out = outputs[0];
    check_tensor(out, "reduce_scatter", "output");
    std::vector<at::Tensor> ins;
    check_list(inputs[0], width, out, "reduce_scatter", "input_list", "output tensor");
    for (auto& i : inputs[0]) ins.push_back(i.contiguous());
    DType dt = to_dtype(out.scalar_type(), "reduce_scatter", "output");
    RedOp op = to_redop(opts.reduceOp, out, "reduce_scatter");
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(
        c10d::OpType::REDUCE_SCATTER,
        [this, out, ins, dt, op, timeout, width] {
          OutBuf buf(out);
          std::vector<const void*> ptrs;
          for (auto& i : ins) ptrs.push_back(i.data_ptr());
          comm_->reduce_scatter(ptrs.data(), buf.ptr(), elems(out), dt, op, timeout, width);
          buf.commit();
        },
        {out}, !opts.asyncOp);
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> outs{output}, ins{input};
  return reduce_scatter_tensor_coalesced(outs, ins, opts);
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return collective([&] {
    check_count(outputs.size(), inputs.size(), "reduce_scatter_tensor", "output tensors");
    std::vector<std::tuple<at::Tensor, at::Tensor, DType, RedOp, int>> items;
    for (size_t i = 0; i < inputs.size(); ++i) {
      check_tensor(inputs[i], "reduce_scatter_tensor", "input");
      check_tensor(outputs[i], "reduce_scatter_tensor", "output");
      MC_CHECK_ARG(outputs[i].scalar_type() == inputs[i].scalar_type(),
                   "reduce_scatter_tensor: output dtype differs from input dtype");
      const int width = parts_width(inputs[i].numel(), outputs[i].numel());
      MC_CHECK_ARG(inputs[i].numel() == outputs[i].numel() * width,
                   "reduce_scatter_tensor: input must have world_size * output numel = ",
                   outputs[i].numel() * width, " elements, got ", inputs[i].numel());
      items.emplace_back(outputs[i], inputs[i],
                         to_dtype(inputs[i].scalar_type(), "reduce_scatter_tensor", "input"),
                         to_redop(opts.reduceOp, inputs[i], "reduce_scatter_tensor"), width);
    }
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(
        c10d::OpType::_REDUCE_SCATTER_BASE,
        [this, items, timeout] {
          for (auto& [output, input, dt, op, width] : items) {
            at::Tensor src = input.contiguous();
            OutBuf out(output);
            size_t bytes = out.buf.nbytes();
            std::vector<const void*> ptrs;
            for (int p = 0; p < width; ++p)
              ptrs.push_back(static_cast<const uint8_t*>(src.data_ptr()) + p * bytes);
            comm_->reduce_scatter(ptrs.data(), out.ptr(), elems(output), dt, op, timeout, width);
            out.commit();
          }
        },
        outputs, !opts.asyncOp);
  });
}

}  // namespace mooncake
