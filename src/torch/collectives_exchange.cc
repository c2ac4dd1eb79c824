// MooncakeBackend's collectives that move data without reducing it
// (broadcast, all_gather, gather, scatter, all_to_all and their coalesced
// forms) and the barrier: each checks its arguments on the caller's thread
// and queues the core's op (see collective() and enqueue() in backend.h).
#include <tuple>

#include "torch/backend.h"
#include "torch/tensor_args.h"
#include "torch/work.h"

namespace mooncake {

c10::intrusive_ptr<c10d::Work> MooncakeBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  return collective([&] {
    check_count(tensors.size(), 1, "broadcast", "tensors");
    check_tensor(tensors[0], "broadcast", "tensor");
    check_rank(opts.rootRank, static_cast<int>(extended_size_), "broadcast", "src");
    at::Tensor t = tensors[0];
    DType dt = to_dtype(t.scalar_type(), "broadcast", "tensor");
    int root = static_cast<int>(opts.rootRank);
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(
        c10d::OpType::BROADCAST,
        [this, t, dt, root, timeout] {
          OutBuf out(t);
          comm_->broadcast(out.ptr(), elems(t), dt, root, timeout);
          out.commit();
        },
        {t}, !opts.asyncOp);
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return collective([&] {
    check_count(inputs.size(), 1, "all_gather", "input tensors");
    check_count(outputs.size(), 1, "all_gather", "output tensor lists");
    at::Tensor in = inputs[0];
    check_tensor(in, "all_gather", "tensor");
    const int width = list_width(outputs[0].size(), "all_gather", "tensor_list");
    check_list(outputs[0], width, in, "all_gather", "tensor_list", "input tensor");
    DType dt = to_dtype(in.scalar_type(), "all_gather", "tensor");
    std::vector<at::Tensor> outs = outputs[0];
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(
        c10d::OpType::ALLGATHER,
        [this, in, outs, dt, timeout, width] {
          at::Tensor src = in.contiguous();
          std::vector<OutBuf> bufs;
          std::vector<void*> ptrs;
          for (auto& o : outs) {
            bufs.emplace_back(o);
            ptrs.push_back(bufs.back().ptr());
          }
          comm_->all_gather(src.data_ptr(), elems(src), dt, ptrs.data(), timeout, width);
          for (auto& b : bufs) b.commit();
        },
        outs, !opts.asyncOp);
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  std::vector<at::Tensor> outs{output}, ins{input};
  return allgather_into_tensor_coalesced(outs, ins, opts);
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  check_count(outputs.size(), inputs.size(), "all_gather_coalesced", "output_tensor_lists");
  std::vector<std::shared_ptr<Request>> parts;
  std::vector<FailedRanks> failed;
  std::vector<at::Tensor> results;
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::vector<std::vector<at::Tensor>> o{outputs[i]};
    std::vector<at::Tensor> in{inputs[i]};
    auto work = allgather(o, in, opts);
    auto* part = static_cast<MooncakeWork*>(work.get());
    parts.push_back(part->request());
    failed.insert(failed.end(), part->failed_records().begin(), part->failed_records().end());
    results.insert(results.end(), outputs[i].begin(), outputs[i].end());
  }
  return c10::make_intrusive<MooncakeWork>(rank_, c10d::OpType::ALLGATHER_COALESCED, all_of(parts),
                                           results, std::weak_ptr<OpQueue>{}, slots(),
                                           std::move(failed));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return collective([&] {
    check_count(outputs.size(), inputs.size(), "all_gather_into_tensor", "output tensors");
    std::vector<std::tuple<at::Tensor, at::Tensor, DType, int>> items;
    for (size_t i = 0; i < inputs.size(); ++i) {
      check_tensor(inputs[i], "all_gather_into_tensor", "input_tensor");
      check_tensor(outputs[i], "all_gather_into_tensor", "output_tensor");
      MC_CHECK_ARG(outputs[i].scalar_type() == inputs[i].scalar_type(),
                   "all_gather_into_tensor: output_tensor dtype ",
                   dtype_str(outputs[i].scalar_type()), " differs from input_tensor dtype ",
                   dtype_str(inputs[i].scalar_type()));
      const int width = parts_width(outputs[i].numel(), inputs[i].numel());
      MC_CHECK_ARG(outputs[i].numel() == inputs[i].numel() * width,
                   "all_gather_into_tensor: output_tensor must have world_size * input numel = ",
                   inputs[i].numel() * width, " elements, got ", outputs[i].numel());
      items.emplace_back(
          outputs[i], inputs[i],
          to_dtype(inputs[i].scalar_type(), "all_gather_into_tensor", "input_tensor"), width);
    }
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(
        c10d::OpType::_ALLGATHER_BASE,
        [this, items, timeout] {
          for (auto& [output, input, dt, width] : items) {
            at::Tensor src = input.contiguous();
            OutBuf out(output);
            size_t bytes = src.nbytes();
            std::vector<void*> ptrs;
            for (int p = 0; p < width; ++p)
              ptrs.push_back(static_cast<uint8_t*>(out.ptr()) + p * bytes);
            comm_->all_gather(src.data_ptr(), elems(src), dt, ptrs.data(), timeout, width);
            out.commit();
          }
        },
        outputs, !opts.asyncOp);
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  return collective([&] {
    check_count(inputs.size(), 1, "gather", "input tensors");
    check_rank(opts.rootRank, static_cast<int>(extended_size_), "gather", "dst");
    at::Tensor in = inputs[0];
    check_tensor(in, "gather", "tensor");
    int root = static_cast<int>(opts.rootRank);
    std::vector<at::Tensor> outs;
    int width = 0;
    if (rank_ == root) {
      check_count(outputs.size(), 1, "gather", "output tensor lists");
      width = list_width(outputs[0].size(), "gather", "gather_list");
      check_list(outputs[0], width, in, "gather", "gather_list", "input tensor");
      outs = outputs[0];
    } else {
      MC_CHECK_ARG(outputs.empty() || outputs[0].empty(),
                   "gather: gather_list must be empty on non-destination ranks");
    }
    DType dt = to_dtype(in.scalar_type(), "gather", "tensor");
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(
        c10d::OpType::GATHER,
        [this, in, outs, dt, root, timeout, width] {
          at::Tensor src = in.contiguous();
          std::vector<OutBuf> bufs;
          std::vector<void*> ptrs;
          for (auto& o : outs) {
            bufs.emplace_back(o);
            ptrs.push_back(bufs.back().ptr());
          }
          comm_->gather(src.data_ptr(), elems(src), dt, ptrs.data(), root, timeout, width);
          for (auto& b : bufs) b.commit();
        },
        outs, !opts.asyncOp);
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  return collective([&] {
    check_count(outputs.size(), 1, "scatter", "output tensors");
    check_rank(opts.rootRank, static_cast<int>(extended_size_), "scatter", "src");
    at::Tensor out = outputs[0];
    check_tensor(out, "scatter", "tensor");
    int root = static_cast<int>(opts.rootRank);
    std::vector<at::Tensor> ins;
    int width = 0;
    if (rank_ == root) {
      check_count(inputs.size(), 1, "scatter", "input tensor lists");
      width = list_width(inputs[0].size(), "scatter", "scatter_list");
      check_list(inputs[0], width, out, "scatter", "scatter_list", "output tensor");
      for (auto& i : inputs[0]) ins.push_back(i.contiguous());
    } else {
      MC_CHECK_ARG(inputs.empty() || inputs[0].empty(),
                   "scatter: scatter_list must be empty on non-source ranks");
    }
    DType dt = to_dtype(out.scalar_type(), "scatter", "tensor");
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(
        c10d::OpType::SCATTER,
        [this, out, ins, dt, root, timeout, width] {
          OutBuf buf(out);
          std::vector<const void*> ptrs;
          for (auto& i : ins) ptrs.push_back(i.data_ptr());
          comm_->scatter(ptrs.data(), buf.ptr(), elems(out), dt, root, timeout, width);
          buf.commit();
        },
        {out}, !opts.asyncOp);
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& opts) {
  return collective([&] {
    check_tensor(input, "all_to_all_single", "input");
    check_tensor(output, "all_to_all_single", "output");
    MC_CHECK_ARG(input.scalar_type() == output.scalar_type(),
                 "all_to_all_single: output dtype differs from input dtype");
    // Given splits may have one entry per rank of the extended group; equal
    // splits are over as many ranks as the given list has (the world size
    // when neither is given).
    const bool in_given = !input_split_sizes.empty();
    const std::vector<int64_t>& given = in_given ? input_split_sizes : output_split_sizes;
    const int width = given.empty()
                          ? size_
                          : list_width(given.size(), "all_to_all_single",
                                       in_given ? "input_split_sizes" : "output_split_sizes");
    std::vector<size_t> in_counts =
        split_counts(input, input_split_sizes, width, "input_split_sizes", "input");
    std::vector<size_t> out_counts =
        split_counts(output, output_split_sizes, width, "output_split_sizes", "output");
    DType dt = to_dtype(input.scalar_type(), "all_to_all_single", "input");
    int64_t timeout = op_timeout_ms(opts.timeout);
    at::Tensor in = input, out = output;
    return enqueue(
        c10d::OpType::ALLTOALL_BASE,
        [this, in, out, in_counts, out_counts, dt, timeout, width] {
          at::Tensor src = in.contiguous();
          OutBuf buf(out);
          const size_t esize = dtype_size(dt);
          std::vector<const void*> ins;
          std::vector<void*> outs;
          size_t a = 0, b = 0;
          for (int p = 0; p < width; ++p) {
            ins.push_back(static_cast<const uint8_t*>(src.data_ptr()) + a * esize);
            outs.push_back(static_cast<uint8_t*>(buf.ptr()) + b * esize);
            a += in_counts[p];
            b += out_counts[p];
          }
          comm_->all_to_all(ins.data(), in_counts.data(), outs.data(), out_counts.data(), dt,
                            timeout, width);
          buf.commit();
        },
        {output}, !opts.asyncOp);
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllToAllOptions& opts) {
  return collective([&] {
    const int width = list_width(outputs.size(), "all_to_all", "output_tensor_list");
    check_count(inputs.size(), static_cast<size_t>(width), "all_to_all", "input_tensor_list");
    for (auto& t : inputs) check_tensor(t, "all_to_all", "input_tensor_list");
    for (auto& t : outputs) {
      check_tensor(t, "all_to_all", "output_tensor_list");
      MC_CHECK_ARG(t.scalar_type() == inputs[0].scalar_type(),
                   "all_to_all: every tensor must have the same dtype");
    }
    DType dt = to_dtype(inputs[0].scalar_type(), "all_to_all", "input_tensor_list");
    std::vector<at::Tensor> ins, outs = outputs;
    for (auto& t : inputs) {
      MC_CHECK_ARG(t.scalar_type() == inputs[0].scalar_type(),
                   "all_to_all: every tensor must have the same dtype");
      ins.push_back(t.contiguous());
    }
    int64_t timeout = op_timeout_ms(opts.timeout);
    return enqueue(
        c10d::OpType::ALLTOALL,
        [this, ins, outs, dt, timeout, width] {
          std::vector<OutBuf> bufs;
          std::vector<const void*> in_ptrs;
          std::vector<void*> out_ptrs;
          std::vector<size_t> in_counts, out_counts;
          for (int p = 0; p < width; ++p) {
            bufs.emplace_back(outs[p]);
            in_ptrs.push_back(ins[p].data_ptr());
            in_counts.push_back(elems(ins[p]));
            out_ptrs.push_back(bufs.back().ptr());
            out_counts.push_back(elems(outs[p]));
          }
          comm_->all_to_all(in_ptrs.data(), in_counts.data(), out_ptrs.data(), out_counts.data(),
                            dt, timeout, width);
          for (auto& b : bufs) b.commit();
        },
        outputs, !opts.asyncOp);
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::barrier(const c10d::BarrierOptions& opts) {
  int64_t timeout = op_timeout_ms(opts.timeout);
  return enqueue(
      c10d::OpType::BARRIER, [this, timeout] { comm_->barrier(timeout); }, {}, !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::reject_next(const std::string& reason) {
  MC_CHECK_ARG(!reason.empty(), "reject_next: reason must not be empty");
  int64_t timeout = timeout_ms_;
  return enqueue(c10d::OpType::UNKNOWN, [this, reason, timeout] { comm_->reject(reason, timeout); },
                 {});
}

}  // namespace mooncake
