// tandem as a torch.distributed backend: a c10d::ProcessGroup whose collectives are tandem's
// non-blocking ones on one td_comm, and a c10d::Work per call that completes with tandem's
// request. This is the whole adapter: it converts tensors to (buffer, count, dtype), stages
// list arguments through one flat tensor where tandem takes one buffer, and turns a failed
// request into an exception carrying tandem's message. It keeps no state of its own beyond
// the group and the requests in flight; ordering, mismatch detection, timeouts and dead peers
// are tandem's (include/tandem/comm.h).
#pragma once

#include <ATen/core/ivalue.h>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "tandem/comm.h"
#include "tandem/store.h"

namespace tandem_torch {

class ProcessGroupTandem;

// One call in flight. It owns the request until the request completes: a caller's wait()
// completes it on the caller's thread (the short path); getFuture() hands it to the group's
// completion thread instead, so that the future completes without a waiter (DDP's path).
// `keep` holds the tensors tandem reads or writes until then; `after` copies a staged result
// out (an all-gather into a list) once the request succeeded.
class WorkTandem : public c10d::Work {
  public:
    WorkTandem(c10::intrusive_ptr<ProcessGroupTandem> pg, c10d::OpType type, td_request *req,
               std::vector<at::Tensor> outputs, std::vector<at::Tensor> keep,
               std::function<void()> after);
    ~WorkTandem() override;

    bool isCompleted() override;
    bool wait(std::chrono::milliseconds timeout) override;
    c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
    std::vector<at::Tensor> result() override { return outputs_; }

    // Waits for the request and records its outcome; the completion thread's entry.
    void complete();

  private:
    void settle(td_status status, std::string message);

    c10::intrusive_ptr<ProcessGroupTandem> pg_; // keeps the group (and its td_comm) alive
    std::mutex req_mutex_;                      // whoever completes the request holds it
    td_request *req_;                           // NULL once completed
    bool handed_ = false;                       // the completion thread owns the request
    std::vector<at::Tensor> outputs_, keep_;
    std::function<void()> after_;
    c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class ProcessGroupTandem : public c10d::ProcessGroup {
  public:
    // Takes ownership of `comm`, and of the rendezvous store rank 0 hosts for it.
    ProcessGroupTandem(td_comm *comm, td_store *host_store = nullptr);
    ~ProcessGroupTandem() override;

    const std::string getBackendName() const override { return "tandem"; }

    c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor> &tensors,
                                             const c10d::BroadcastOptions &opts) override;
    c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor> &tensors,
                                             const c10d::AllreduceOptions &opts) override;
    c10::intrusive_ptr<c10d::Work>
    allreduce_coalesced(std::vector<at::Tensor> &tensors,
                        const c10d::AllreduceCoalescedOptions &opts) override;
    c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor> &tensors,
                                          const c10d::ReduceOptions &opts) override;
    c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>> &outputs,
                                             std::vector<at::Tensor> &inputs,
                                             const c10d::AllgatherOptions &opts) override;
    c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor &output, at::Tensor &input,
                                                   const c10d::AllgatherOptions &opts) override;
    c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>> &outputs,
                                          std::vector<at::Tensor> &inputs,
                                          const c10d::GatherOptions &opts) override;
    c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor> &outputs,
                                           std::vector<std::vector<at::Tensor>> &inputs,
                                           const c10d::ScatterOptions &opts) override;
    c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor> &outputs,
                                                  std::vector<std::vector<at::Tensor>> &inputs,
                                                  const c10d::ReduceScatterOptions &opts) override;
    c10::intrusive_ptr<c10d::Work>
    _reduce_scatter_base(at::Tensor &output, at::Tensor &input,
                         const c10d::ReduceScatterOptions &opts) override;
    c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor &output, at::Tensor &input,
                                                 std::vector<int64_t> &output_splits,
                                                 std::vector<int64_t> &input_splits,
                                                 const c10d::AllToAllOptions &opts) override;
    c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor> &outputs,
                                            std::vector<at::Tensor> &inputs,
                                            const c10d::AllToAllOptions &opts) override;
    c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions &opts) override;
    c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor> &tensors, int dst,
                                        int tag) override;
    c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor> &tensors, int src,
                                        int tag) override;
    c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor> &tensors,
                                                 int tag) override;

    td_comm *comm() { return comm_; }

    // Queues `work` for the completion thread (started on first use).
    void hand_over(c10::intrusive_ptr<WorkTandem> work);

    // The completion thread's queue. Shared with the thread, because the thread may drop the
    // last reference to a work and with it the group: the group's destructor then runs on that
    // thread, detaches it, and the thread ends on state that is still alive.
    struct Completion {
        std::mutex mutex;
        std::condition_variable cond;
        std::deque<c10::intrusive_ptr<WorkTandem>> queue;
        bool stop = false;
    };

  private:
    c10::intrusive_ptr<c10d::Work> launch(c10d::OpType type, td_status status, td_request *req,
                                          std::vector<at::Tensor> outputs,
                                          std::vector<at::Tensor> keep,
                                          std::function<void()> after = nullptr);

    td_comm *comm_;
    td_store *host_store_; // rank 0: the rendezvous store it hosts, closed after the group
    std::shared_ptr<Completion> completion_;
    std::thread thread_;
};

// The creator torch.distributed calls for init_process_group("tandem") and new_group: meets
// the group's other ranks through PyTorch's store (store.hpp's rendezvous) and returns the
// process group.
c10::intrusive_ptr<c10d::ProcessGroup>
create_process_group(const c10::intrusive_ptr<c10d::Store> &store, int rank, int size,
                     std::chrono::milliseconds timeout);

} // namespace tandem_torch
