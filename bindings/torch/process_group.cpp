// The collectives of the tandem backend: each checks its tensors, maps them to tandem's
// (buffer, count, dtype), starts tandem's non-blocking call and returns a WorkTandem.
//
// Tensors must be dense, contiguous CPU tensors; others are refused with the call's name, as
// are reductions of dtypes tandem does not reduce. Calls that only move bytes (broadcast,
// gathers, scatter, all-to-all, send and recv) take any dtype: what tandem has no name for
// travels as bytes. Where PyTorch passes a list of tensors and tandem takes one buffer (the
// list forms of all-gather, gather, scatter, reduce-scatter, all-to-all, and the coalesced
// all-reduce), the list is staged through one flat tensor. Arguments that PyTorch checks on
// one rank only (a root outside the group) are tandem's to reject, on every rank alike.
#include "process_group.hpp"

#include <ATen/ATen.h>

namespace tandem_torch {
namespace {

// tandem's dtype for `t`, or TD_DTYPE_COUNT where tandem has none.
td_dtype dtype_of(at::ScalarType t) {
    switch (t) {
    case at::kFloat:
        return TD_F32;
    case at::kDouble:
        return TD_F64;
    case at::kBFloat16:
        return TD_BF16;
    case at::kHalf:
        return TD_F16;
    case at::kInt:
        return TD_I32;
    case at::kLong:
        return TD_I64;
    case at::kByte:
        return TD_U8;
    default:
        return TD_DTYPE_COUNT;
    }
}

// A tensor as tandem's buffer.
struct Buf {
    void *ptr;
    size_t count;
    td_dtype dtype;
};

// For calls that move bytes: the tensor's own dtype where tandem has it, else its bytes.
Buf bytes_of(const at::Tensor &t) {
    td_dtype d = dtype_of(t.scalar_type());
    if (d != TD_DTYPE_COUNT) return {t.data_ptr(), (size_t)t.numel(), d};
    return {t.data_ptr(), (size_t)t.numel() * t.element_size(), TD_U8};
}

// For reductions: the tensor's dtype must be one tandem reduces.
Buf values_of(const at::Tensor &t, const char *call) {
    td_dtype d = dtype_of(t.scalar_type());
    TORCH_CHECK(d != TD_DTYPE_COUNT, "tandem: ", call, ": cannot reduce ", t.scalar_type(),
                " tensors (float32, float64, bfloat16, float16, int32, int64 and uint8 can be)");
    return {t.data_ptr(), (size_t)t.numel(), d};
}

td_reduce_op op_of(const c10d::ReduceOp &op, const char *call) {
    switch (op.op_) {
    case c10d::ReduceOp::SUM:
        return TD_OP_SUM;
    case c10d::ReduceOp::AVG:
        return TD_OP_AVG;
    case c10d::ReduceOp::PRODUCT:
        return TD_OP_PROD;
    case c10d::ReduceOp::MIN:
        return TD_OP_MIN;
    case c10d::ReduceOp::MAX:
        return TD_OP_MAX;
    default:
        TORCH_CHECK(false, "tandem: ", call, ": reduce op ", (int)op.op_,
                    " is not supported (SUM, AVG, PRODUCT, MIN and MAX are)");
    }
}

void check_tensor(const at::Tensor &t, const char *call, const char *which) {
    TORCH_CHECK(t.defined(), "tandem: ", call, ": ", which, " is an undefined tensor");
    TORCH_CHECK(t.device().is_cpu(), "tandem: ", call, ": ", which, " is on ", t.device(),
                "; the tandem backend takes CPU tensors");
    TORCH_CHECK(t.layout() == at::kStrided, "tandem: ", call, ": ", which, " is not dense (",
                t.layout(), ")");
    TORCH_CHECK(t.is_contiguous(), "tandem: ", call, ": ", which, " is not contiguous (sizes ",
                t.sizes(), ", strides ", t.strides(), "); pass tensor.contiguous()");
}

// The one tensor of a per-device list (CPU calls have one device).
at::Tensor &only(std::vector<at::Tensor> &tensors, const char *call) {
    TORCH_CHECK(tensors.size() == 1, "tandem: ", call, " takes one tensor per call, got ",
                tensors.size());
    check_tensor(tensors[0], call, "the tensor");
    return tensors[0];
}

// A list of `n` tensors each like `like` (dtype and number of elements); they may be strided,
// as they are copied to or from a flat stage.
void check_list(const std::vector<at::Tensor> &list, size_t n, const at::Tensor &like,
                const char *call, const char *which) {
    TORCH_CHECK(list.size() == n, "tandem: ", call, ": ", which, " holds ", list.size(),
                " tensors, the group has ", n, " ranks");
    for (size_t i = 0; i < list.size(); i++) {
        const at::Tensor &t = list[i];
        TORCH_CHECK(t.defined() && t.device().is_cpu() && t.layout() == at::kStrided,
                    "tandem: ", call, ": ", which, "[", i, "] is not a dense CPU tensor");
        TORCH_CHECK(t.scalar_type() == like.scalar_type() && t.numel() == like.numel(),
                    "tandem: ", call, ": ", which, "[", i, "] is ", t.scalar_type(), " with ",
                    t.numel(), " elements, expected ", like.scalar_type(), " with ", like.numel());
    }
}

// The list's tensors one after another in one contiguous tensor.
at::Tensor flatten(const std::vector<at::Tensor> &list) {
    std::vector<at::Tensor> flat;
    flat.reserve(list.size());
    for (const at::Tensor &t : list) flat.push_back(t.reshape({-1}));
    return at::cat(flat);
}

// Copies consecutive pieces of `flat` into the list's tensors.
void unflatten(const at::Tensor &flat, std::vector<at::Tensor> &list) {
    int64_t at = 0;
    for (at::Tensor &t : list) {
        t.copy_(flat.narrow(0, at, t.numel()).view(t.sizes()));
        at += t.numel();
    }
}

// The flight recorder keeps PyTorch's name for each call (tandem/recorder.h), so that a dump
// and its diagnosis say "all_reduce", as the program does.
void record_as(td_comm *comm, c10d::OpType type) {
    const char *name = "?";
    switch (type) {
    case c10d::OpType::BROADCAST:
        name = "broadcast";
        break;
    case c10d::OpType::ALLREDUCE:
        name = "all_reduce";
        break;
    case c10d::OpType::ALLREDUCE_COALESCED:
        name = "all_reduce_coalesced";
        break;
    case c10d::OpType::REDUCE:
        name = "reduce";
        break;
    case c10d::OpType::ALLGATHER:
        name = "all_gather";
        break;
    case c10d::OpType::_ALLGATHER_BASE:
        name = "all_gather_into_tensor";
        break;
    case c10d::OpType::GATHER:
        name = "gather";
        break;
    case c10d::OpType::SCATTER:
        name = "scatter";
        break;
    case c10d::OpType::REDUCE_SCATTER:
        name = "reduce_scatter";
        break;
    case c10d::OpType::_REDUCE_SCATTER_BASE:
        name = "reduce_scatter_tensor";
        break;
    case c10d::OpType::ALLTOALL_BASE:
        name = "all_to_all_single";
        break;
    case c10d::OpType::ALLTOALL:
        name = "all_to_all";
        break;
    case c10d::OpType::BARRIER:
        name = "barrier";
        break;
    case c10d::OpType::SEND:
        name = "send";
        break;
    case c10d::OpType::RECV:
        name = "recv";
        break;
    default:
        break;
    }
    td_comm_tag(comm, "torch %s", name);
}

} // namespace

ProcessGroupTandem::ProcessGroupTandem(td_comm *comm, td_store *host_store)
    : c10d::ProcessGroup(td_comm_rank(comm), td_comm_size(comm)), comm_(comm),
      host_store_(host_store), completion_(std::make_shared<Completion>()) {
    init();
}

ProcessGroupTandem::~ProcessGroupTandem() {
    {
        std::lock_guard<std::mutex> guard(completion_->mutex);
        completion_->stop = true;
        completion_->cond.notify_one();
    }
    if (thread_.joinable()) {
        if (thread_.get_id() == std::this_thread::get_id())
            thread_.detach();
        else
            thread_.join();
    }
    td_comm_destroy(comm_);
    td_store_destroy(host_store_);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTandem::launch(c10d::OpType type, td_status status,
                                                          td_request *req,
                                                          std::vector<at::Tensor> outputs,
                                                          std::vector<at::Tensor> keep,
                                                          std::function<void()> after) {
    TORCH_CHECK(status == TD_OK, "tandem: ", td_last_error());
    return c10::make_intrusive<WorkTandem>(
        c10::intrusive_ptr<ProcessGroupTandem>::unsafe_reclaim_from_nonowning(this), type, req,
        std::move(outputs), std::move(keep), std::move(after));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTandem::broadcast(std::vector<at::Tensor> &tensors,
                                                             const c10d::BroadcastOptions &opts) {
    at::Tensor &t = only(tensors, "broadcast");
    TORCH_CHECK(opts.rootTensor == 0, "tandem: broadcast: root tensor ", opts.rootTensor,
                " (one tensor per call)");
    Buf b = bytes_of(t);
    td_request *req = nullptr;
    record_as(comm_, c10d::OpType::BROADCAST);
    td_status s = td_comm_ibroadcast(comm_, b.ptr, b.count, b.dtype, (int)opts.rootRank, &req);
    return launch(c10d::OpType::BROADCAST, s, req, {t}, {t});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTandem::allreduce(std::vector<at::Tensor> &tensors,
                                                             const c10d::AllreduceOptions &opts) {
    at::Tensor &t = only(tensors, "allreduce");
    Buf b = values_of(t, "allreduce");
    td_reduce_op op = op_of(opts.reduceOp, "allreduce");
    td_request *req = nullptr;
    record_as(comm_, c10d::OpType::ALLREDUCE);
    td_status s = td_comm_iallreduce(comm_, b.ptr, b.ptr, b.count, b.dtype, op, &req);
    return launch(c10d::OpType::ALLREDUCE, s, req, {t}, {t});
}

c10::intrusive_ptr<c10d::Work>
ProcessGroupTandem::allreduce_coalesced(std::vector<at::Tensor> &tensors,
                                        const c10d::AllreduceCoalescedOptions &opts) {
    TORCH_CHECK(!tensors.empty(), "tandem: allreduce_coalesced: no tensors");
    for (const at::Tensor &t : tensors) {
        check_tensor(t, "allreduce_coalesced", "a tensor");
        TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type(),
                    "tandem: allreduce_coalesced: ", "the tensors mix ", tensors[0].scalar_type(),
                    " and ", t.scalar_type());
    }
    at::Tensor flat = flatten(tensors);
    Buf b = values_of(flat, "allreduce_coalesced");
    td_reduce_op op = op_of(opts.reduceOp, "allreduce_coalesced");
    td_request *req = nullptr;
    record_as(comm_, c10d::OpType::ALLREDUCE_COALESCED);
    td_status s = td_comm_iallreduce(comm_, b.ptr, b.ptr, b.count, b.dtype, op, &req);
    std::vector<at::Tensor> outs = tensors;
    return launch(c10d::OpType::ALLREDUCE_COALESCED, s, req, outs, {flat},
                  [flat, outs]() mutable { unflatten(flat, outs); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTandem::reduce(std::vector<at::Tensor> &tensors,
                                                          const c10d::ReduceOptions &opts) {
    at::Tensor &t = only(tensors, "reduce");
    Buf b = values_of(t, "reduce");
    td_reduce_op op = op_of(opts.reduceOp, "reduce");
    td_request *req = nullptr;
    record_as(comm_, c10d::OpType::REDUCE);
    td_status s =
        td_comm_ireduce(comm_, b.ptr, b.ptr, b.count, b.dtype, op, (int)opts.rootRank, &req);
    return launch(c10d::OpType::REDUCE, s, req, {t}, {t});
}

c10::intrusive_ptr<c10d::Work>
ProcessGroupTandem::allgather(std::vector<std::vector<at::Tensor>> &outputs,
                              std::vector<at::Tensor> &inputs, const c10d::AllgatherOptions &) {
    at::Tensor &in = only(inputs, "allgather");
    TORCH_CHECK(outputs.size() == 1, "tandem: allgather takes one output list, got ",
                outputs.size());
    std::vector<at::Tensor> &outs = outputs[0];
    check_list(outs, (size_t)size_, in, "allgather", "the output list");
    at::Tensor flat = at::empty({(int64_t)size_ * in.numel()}, in.options());
    Buf b = bytes_of(in);
    td_request *req = nullptr;
    record_as(comm_, c10d::OpType::ALLGATHER);
    td_status s = td_comm_iallgather(comm_, b.ptr, flat.data_ptr(), b.count, b.dtype, &req);
    return launch(c10d::OpType::ALLGATHER, s, req, outs, {in, flat},
                  [flat, outs]() mutable { unflatten(flat, outs); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTandem::_allgather_base(at::Tensor &output,
                                                                   at::Tensor &input,
                                                                   const c10d::AllgatherOptions &) {
    check_tensor(input, "_allgather_base", "the input");
    check_tensor(output, "_allgather_base", "the output");
    TORCH_CHECK(output.scalar_type() == input.scalar_type() &&
                    output.numel() == (int64_t)size_ * input.numel(),
                "tandem: _allgather_base: the output is ", output.scalar_type(), " with ",
                output.numel(), " elements, expected ", input.scalar_type(), " with ", size_, " x ",
                input.numel());
    Buf b = bytes_of(input);
    td_request *req = nullptr;
    record_as(comm_, c10d::OpType::_ALLGATHER_BASE);
    td_status s = td_comm_iallgather(comm_, b.ptr, output.data_ptr(), b.count, b.dtype, &req);
    return launch(c10d::OpType::_ALLGATHER_BASE, s, req, {output}, {input, output});
}

c10::intrusive_ptr<c10d::Work>
ProcessGroupTandem::gather(std::vector<std::vector<at::Tensor>> &outputs,
                           std::vector<at::Tensor> &inputs, const c10d::GatherOptions &opts) {
    at::Tensor &in = only(inputs, "gather");
    at::Tensor flat;
    std::vector<at::Tensor> outs;
    if (rank_ == opts.rootRank) {
        TORCH_CHECK(outputs.size() == 1, "tandem: gather: the root takes one output list, got ",
                    outputs.size());
        outs = outputs[0];
        check_list(outs, (size_t)size_, in, "gather", "the root's output list");
        flat = at::empty({(int64_t)size_ * in.numel()}, in.options());
    } else {
        TORCH_CHECK(outputs.empty(), "tandem: gather: rank ", rank_,
                    " is not the root and takes no output list");
    }
    Buf b = bytes_of(in);
    td_request *req = nullptr;
    record_as(comm_, c10d::OpType::GATHER);
    td_status s = td_comm_igather(comm_, b.ptr, flat.defined() ? flat.data_ptr() : nullptr, b.count,
                                  b.dtype, (int)opts.rootRank, &req);
    std::function<void()> after;
    if (flat.defined()) after = [flat, outs]() mutable { unflatten(flat, outs); };
    std::vector<at::Tensor> keep = {in};
    if (flat.defined()) keep.push_back(flat);
    return launch(c10d::OpType::GATHER, s, req, outs, keep, after);
}

c10::intrusive_ptr<c10d::Work>
ProcessGroupTandem::scatter(std::vector<at::Tensor> &outputs,
                            std::vector<std::vector<at::Tensor>> &inputs,
                            const c10d::ScatterOptions &opts) {
    at::Tensor &out = only(outputs, "scatter");
    at::Tensor flat;
    if (rank_ == opts.rootRank) {
        TORCH_CHECK(inputs.size() == 1, "tandem: scatter: the root takes one input list, got ",
                    inputs.size());
        check_list(inputs[0], (size_t)size_, out, "scatter", "the root's input list");
        flat = flatten(inputs[0]);
    } else {
        TORCH_CHECK(inputs.empty(), "tandem: scatter: rank ", rank_,
                    " is not the root and takes no input list");
    }
    Buf b = bytes_of(out);
    td_request *req = nullptr;
    record_as(comm_, c10d::OpType::SCATTER);
    td_status s = td_comm_iscatter(comm_, flat.defined() ? flat.data_ptr() : nullptr, b.ptr,
                                   b.count, b.dtype, (int)opts.rootRank, &req);
    std::vector<at::Tensor> keep = {out};
    if (flat.defined()) keep.push_back(flat);
    return launch(c10d::OpType::SCATTER, s, req, {out}, keep);
}

c10::intrusive_ptr<c10d::Work>
ProcessGroupTandem::reduce_scatter(std::vector<at::Tensor> &outputs,
                                   std::vector<std::vector<at::Tensor>> &inputs,
                                   const c10d::ReduceScatterOptions &opts) {
    at::Tensor &out = only(outputs, "reduce_scatter");
    TORCH_CHECK(inputs.size() == 1, "tandem: reduce_scatter takes one input list, got ",
                inputs.size());
    check_list(inputs[0], (size_t)size_, out, "reduce_scatter", "the input list");
    at::Tensor flat = flatten(inputs[0]);
    Buf b = values_of(out, "reduce_scatter");
    td_reduce_op op = op_of(opts.reduceOp, "reduce_scatter");
    td_request *req = nullptr;
    record_as(comm_, c10d::OpType::REDUCE_SCATTER);
    td_status s =
        td_comm_ireduce_scatter(comm_, flat.data_ptr(), b.ptr, b.count, b.dtype, op, &req);
    return launch(c10d::OpType::REDUCE_SCATTER, s, req, {out}, {out, flat});
}

c10::intrusive_ptr<c10d::Work>
ProcessGroupTandem::_reduce_scatter_base(at::Tensor &output, at::Tensor &input,
                                         const c10d::ReduceScatterOptions &opts) {
    check_tensor(input, "_reduce_scatter_base", "the input");
    check_tensor(output, "_reduce_scatter_base", "the output");
    TORCH_CHECK(output.scalar_type() == input.scalar_type() &&
                    input.numel() == (int64_t)size_ * output.numel(),
                "tandem: _reduce_scatter_base: the input is ", input.scalar_type(), " with ",
                input.numel(), " elements, expected ", output.scalar_type(), " with ", size_, " x ",
                output.numel());
    Buf b = values_of(output, "_reduce_scatter_base");
    td_reduce_op op = op_of(opts.reduceOp, "_reduce_scatter_base");
    td_request *req = nullptr;
    record_as(comm_, c10d::OpType::_REDUCE_SCATTER_BASE);
    td_status s =
        td_comm_ireduce_scatter(comm_, input.data_ptr(), b.ptr, b.count, b.dtype, op, &req);
    return launch(c10d::OpType::_REDUCE_SCATTER_BASE, s, req, {output}, {output, input});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTandem::alltoall_base(
    at::Tensor &output, at::Tensor &input, std::vector<int64_t> &output_splits,
    std::vector<int64_t> &input_splits, const c10d::AllToAllOptions &) {
    check_tensor(input, "alltoall_base", "the input");
    check_tensor(output, "alltoall_base", "the output");
    TORCH_CHECK(output.scalar_type() == input.scalar_type() && output.numel() == input.numel() &&
                    input.numel() % size_ == 0,
                "tandem: alltoall_base: input (", input.scalar_type(), ", ", input.numel(),
                " elements) and output (", output.scalar_type(), ", ", output.numel(),
                " elements) must match and divide into ", size_, " equal blocks");
    // tandem's all-to-all moves equal blocks; splits are accepted when they say the same.
    int64_t rows = input.dim() ? input.size(0) : 1;
    for (const std::vector<int64_t> *splits : {&input_splits, &output_splits})
        for (int64_t split : *splits)
            TORCH_CHECK(
                splits->size() == (size_t)size_ && split * size_ == rows,
                "tandem: alltoall_base: uneven splits are not supported (tandem's all-to-all "
                "moves ",
                size_, " equal blocks of ", rows / size_, " rows)");
    Buf b = bytes_of(input);
    td_request *req = nullptr;
    record_as(comm_, c10d::OpType::ALLTOALL_BASE);
    td_status s =
        td_comm_ialltoall(comm_, b.ptr, output.data_ptr(), b.count / (size_t)size_, b.dtype, &req);
    return launch(c10d::OpType::ALLTOALL_BASE, s, req, {output}, {output, input});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTandem::alltoall(std::vector<at::Tensor> &outputs,
                                                            std::vector<at::Tensor> &inputs,
                                                            const c10d::AllToAllOptions &) {
    TORCH_CHECK(!inputs.empty(), "tandem: alltoall: no input tensors");
    // Equal blocks, as in alltoall_base.
    check_list(inputs, (size_t)size_, inputs[0], "alltoall", "the input list");
    check_list(outputs, (size_t)size_, inputs[0], "alltoall", "the output list");
    at::Tensor in = flatten(inputs);
    at::Tensor flat = at::empty_like(in);
    Buf b = bytes_of(in);
    td_request *req = nullptr;
    record_as(comm_, c10d::OpType::ALLTOALL);
    td_status s =
        td_comm_ialltoall(comm_, b.ptr, flat.data_ptr(), b.count / (size_t)size_, b.dtype, &req);
    std::vector<at::Tensor> outs = outputs;
    return launch(c10d::OpType::ALLTOALL, s, req, outs, {in, flat},
                  [flat, outs]() mutable { unflatten(flat, outs); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTandem::barrier(const c10d::BarrierOptions &) {
    td_request *req = nullptr;
    record_as(comm_, c10d::OpType::BARRIER);
    td_status s = td_comm_ibarrier(comm_, &req);
    return launch(c10d::OpType::BARRIER, s, req, {}, {});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTandem::send(std::vector<at::Tensor> &tensors, int dst,
                                                        int tag) {
    at::Tensor &t = only(tensors, "send");
    Buf b = bytes_of(t);
    td_request *req = nullptr;
    record_as(comm_, c10d::OpType::SEND);
    td_status s = td_comm_isend(comm_, b.ptr, b.count, b.dtype, dst, tag, &req);
    return launch(c10d::OpType::SEND, s, req, {t}, {t});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTandem::recv(std::vector<at::Tensor> &tensors, int src,
                                                        int tag) {
    at::Tensor &t = only(tensors, "recv");
    Buf b = bytes_of(t);
    td_request *req = nullptr;
    record_as(comm_, c10d::OpType::RECV);
    td_status s = td_comm_irecv(comm_, b.ptr, b.count, b.dtype, src, tag, &req);
    return launch(c10d::OpType::RECV, s, req, {t}, {t});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTandem::recvAnysource(std::vector<at::Tensor> &, int) {
    TORCH_CHECK(false, "tandem: recv without a source rank is not supported; name the source");
}

} // namespace tandem_torch
