// KaitianBackend: one c10d process group over ranks on different vendors'
// devices. Inside a vendor group it calls the vendor's own backend (built in
// Python and passed in); across groups it goes through a host-memory Bridge.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <unordered_map>

#include "bridge.hpp"
#include "compat.hpp"
#include "work.hpp"

namespace kaitian {

struct Layout {
  std::vector<int> groupOf;              // per rank: index of its vendor group
  std::vector<std::string> groupNames;   // per group
  std::vector<std::string> groupDevice;  // per group: device type ("cpu", "cuda", ...)
  bool flatIntra = true;                 // CPU groups: reduce through the bridge, not the vendor
  int64_t segmentBytes = 16 << 20;       // reductions proceed in segments of this size
  // Per group: dtype and reduce-op names its intra-group vendor cannot reduce
  // (the vendor table's intra_gaps, kaitian/devices/vendors); those reductions go
  // through the bridge, every rank its own source. Empty: no gaps.
  std::vector<std::vector<std::string>> vendorGaps;
  // This rank's accelerator (none on CPU ranks): a barrier waits for its work.
  std::optional<c10::Device> device;
};

struct PinnedRing;

class KaitianBackend : public c10d::Backend {
 public:
  KaitianBackend(int rank, int size, std::chrono::milliseconds timeout, Layout layout,
                 c10::intrusive_ptr<c10d::Backend> intraDevice,
                 c10::intrusive_ptr<c10d::Backend> intraCpu, std::unique_ptr<Bridge> bridge);
  ~KaitianBackend() override;

  const std::string getBackendName() const override { return "kaitian"; }
  void setTimeout(std::chrono::milliseconds timeout) KAITIAN_BACKEND_SET_TIMEOUT_OVERRIDE { timeoutMs_ = timeout.count(); }
  // Both stop the group for good: waiting ops fail, queued ones never run.
  // abort() first aborts the vendors (and never shuts them down gracefully).
  void shutdown() KAITIAN_BACKEND_SHUTDOWN_OVERRIDE;
  void abort() KAITIAN_BACKEND_SHUTDOWN_OVERRIDE;
  void setSequenceNumberForGroup() override { seq_ = 0; }
  uint64_t getSequenceNumberForGroup() override { return seq_; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                               int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // Introspection for Python and tests.
  const Layout& layout() const { return layout_; }
  std::string bridgeKind() const { return bridge_ ? bridge_->kind() : "none"; }
  // Bytes reductions copied device-to-host and host-to-device so far.
  std::pair<int64_t, int64_t> stagedBytes() const { return {stagedIn_.load(), stagedOut_.load()}; }
  bool hasIntra() const { return intraDevice_.defined() || intraCpu_.defined(); }
  // The first failure once the group is broken, else "".
  std::string firstFailure() const { return fail_.broken() ? fail_.first() : ""; }
  // Raises, breaking the group on every rank, when `peer` is gone (exited or
  // closed the group) or the group is broken; returns while it lives. For a
  // rank that waits outside every op for `peer`'s next message (`what`).
  void watchPeer(int peer, const std::string& what);
  // From the next all_reduce this rank issues on, rank r reduces weights[r] /
  // sum(weights) of every segment (empty: even stripes). Every rank must set
  // the same weights before the same collective: their digest is part of the
  // op's identity, so ranks that disagree fail that collective on every rank.
  void setStripeWeights(std::vector<int64_t> weights);
  std::vector<int64_t> stripeWeights() const;
  // While `why` is set, some ranks take part in no collective of this group (hot
  // spares benched by kaitian.Rebalancer): a collective called meanwhile would wait
  // for them, so it fails at once, breaking the group, with `why` ("" clears it).
  void setAway(std::string why);
  // Elements this rank reduced on the host so far, and the seconds that took.
  std::pair<int64_t, double> reduceRate() const;

 private:
  using Body = std::function<int(const Deadline&)>;  // returns the source rank (recv) or -1
  // Runs `body` on `queue` as op `id` (collectives get their sequence number
  // here); once the group is broken, raises instead. `device`: the op's device
  // when its tensors name none (a barrier orders the rank's device as NCCL's does).
  c10::intrusive_ptr<c10d::Work> enqueue(OpQueue& queue, c10d::OpType type, const char* name,
                                         OpId id, std::vector<at::Tensor> outputs,
                                         std::vector<at::Tensor> deviceTensors,
                                         std::chrono::milliseconds timeout, Body body,
                                         std::optional<c10::Device> device = std::nullopt);
  c10::intrusive_ptr<c10d::Work> allreduceSparse(at::Tensor t,
                                                 const c10d::AllreduceOptions& opts);
  // Reduces `flat` (contiguous, 1-D, on its device) over the world: vendor step
  // inside groups that use their vendor, then the bridge across source groups,
  // segment by segment (device tensors: copies of the next segment overlap the
  // bridge work on this one). Rank r ends up with stripes[r] reduced (every
  // stripe when `gather`); empty `stripes` splits each segment in proportion
  // to `weights` (empty: evenly).
  void reduceFlat(at::Tensor& flat, const c10d::ReduceOp& op, std::vector<Range> stripes,
                  bool gather, const Deadline& dl, const std::vector<int64_t>& weights = {});
  // Whether `group` reduces `dtype` with `op` (data movement: no op) through its
  // vendor; the same answer on every rank (layout and table only).
  bool groupUsesVendor(int group, at::ScalarType dtype,
                       std::optional<c10d::ReduceOp::RedOpType> op) const;
  // The device vendor when it alone can run an op on these tensors for the
  // whole world (every rank in its group, contiguous device tensors of a dtype
  // it carries, and for reductions `op` one it reduces); null otherwise.
  c10::intrusive_ptr<c10d::Backend> soleVendor(
      const std::vector<at::Tensor>& tensors,
      std::optional<c10d::ReduceOp::RedOpType> op = std::nullopt) const;
  // Runs a vendor op on `device`'s tensors (`start` issues it) and waits for
  // it, its device work included (NCCL's future completes when the op is
  // queued), noticing the deadline and shutdown/abort. A peer already in
  // another op fails the group before it starts: a vendor fed mismatched
  // calls hangs, or (gloo, on a size mismatch) aborts the process.
  void runVendor(const c10::intrusive_ptr<c10d::Backend>& vendor,
                 const std::function<c10::intrusive_ptr<c10d::Work>()>& start,
                 const c10::Device& device, const Deadline& dl);
  // The collectives thread's pinned segment buffers for `device`, at least `bytes` each.
  PinnedRing& pinnedRing(const c10::Device& device, int64_t bytes);
  void stopAll(bool abort);
  // An op with nothing to move still meets its peers once (a zero-byte
  // exchange carries its identity), so that a rank whose call differs is caught
  // at this call on every rank. Returns -1, the op bodies' "no source rank".
  int meetEmpty(const Deadline& dl);
  // A collective's argument check failed on this rank alone, while its peers
  // are, or will be, waiting for it in that collective: breaks the group
  // (fail-stop) so that they raise at once naming this rank and the error, and
  // rethrows the error to the caller. Called by collective().
  [[noreturn]] void breakOnLocalError(const char* op);
  // What a collective queues once its arguments are checked (see enqueue).
  struct Call {
    c10d::OpType type;
    OpId id;
    std::vector<at::Tensor> outputs, deviceTensors;
    std::chrono::milliseconds timeout;
    Body body;
    std::optional<c10::Device> device = std::nullopt;
  };
  // Every collective's frame: `check` validates the arguments on the caller's
  // thread and returns the op, which is queued on the collectives thread; an
  // argument error breaks the group (breakOnLocalError) and reaches the caller.
  template <typename Check>
  c10::intrusive_ptr<c10d::Work> collective(const char* name, Check check) {
    try {
      {
        std::lock_guard<std::mutex> lock(awayMu_);
        TORCH_CHECK(awayWhy_.empty(), "kaitian ", name, ": ", awayWhy_);
      }
      Call c = check();
      return enqueue(*collectives_, c.type, name, c.id, std::move(c.outputs),
                     std::move(c.deviceTensors), c.timeout, std::move(c.body), c.device);
    } catch (...) {
      breakOnLocalError(name);
    }
  }
  // The root's list of one tensor per rank like `like` (gather_list,
  // scatter_list; `lists` says what they are); the other ranks must pass none.
  std::vector<at::Tensor> rootList(const char* op, const char* list, const char* lists,
                                   std::vector<std::vector<at::Tensor>>& given,
                                   const at::Tensor& like, int root) const;
  // A 1-D copy of `t` in a buffer reused across calls (progress thread only).
  at::Tensor scratchCopy(const at::Tensor& t);
  void exchangeBytes(const uint8_t* blob, int64_t blobLen, std::vector<int64_t> sendOff,
                     std::vector<int64_t> sendLen, std::vector<uint8_t*> recvPtr,
                     std::vector<int64_t> recvLen, const Deadline& dl);
  // Before an exchange whose sizes vary per pair (all-to-all): every rank learns
  // every rank's send and receive sizes, so a pair that disagrees fails the op on
  // all ranks, not only on those two (the others' own transfers match).
  void checkExchangePlan(const std::vector<int64_t>& sendLen,
                         const std::vector<int64_t>& recvLen, const Deadline& dl);

  Layout layout_;
  c10::intrusive_ptr<c10d::Backend> intraDevice_, intraCpu_;
  std::unique_ptr<Bridge> bridge_;
  std::atomic<int64_t> timeoutMs_;  // the group timeout; set_timeout() may change it
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> seq_{0};
  std::atomic<uint64_t> collectiveSeq_{0};  // collectives issued, in issue order
  FailState fail_;              // fail-stop: the first failure, once there is one
  std::mutex shutdownMu_;
  bool shutDown_ = false;
  std::unique_ptr<OpQueue> collectives_, sends_, recvs_;
  at::Tensor scratch_;  // used only by the collectives thread
  // Used only by the collectives thread; one per device (events belong to one).
  std::unordered_map<c10::Device, std::unique_ptr<PinnedRing>> rings_;
  std::atomic<int64_t> stagedIn_{0}, stagedOut_{0};  // see stagedBytes()
  ReduceMeter meter_;  // see reduceRate()
  mutable std::mutex stripeMu_;
  std::vector<int64_t> stripeWeights_;  // see setStripeWeights(); empty: even
  mutable std::mutex awayMu_;
  std::string awayWhy_;  // see setAway(); empty: every rank takes part
  struct Gaps {
    std::vector<at::ScalarType> dtypes;
    std::vector<c10d::ReduceOp::RedOpType> ops;
  };
  std::vector<Gaps> gaps_;  // per group, parsed from layout_.vendorGaps
  std::vector<int> groupMembers_;  // the ranks of this rank's group (its vendor's)
  std::mutex abandonedMu_;
  std::set<const c10d::Backend*> abandoned_;  // vendors with an op we stopped waiting for
};

}  // namespace kaitian
