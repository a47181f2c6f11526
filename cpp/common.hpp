// Shared small types of the kaitian backend: deadlines, ranges, op identities,
// the fail-stop state, errors.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

namespace kaitian {

using Clock = std::chrono::steady_clock;

// A half-open element range [begin, end).
struct Range {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end > begin ? end - begin : 0; }
  Range intersect(const Range& o) const {
    Range r{std::max(begin, o.begin), std::min(end, o.end)};
    if (r.end < r.begin) r.end = r.begin;
    return r;
  }
};

// Part `i` of `n` of [0, total), sizes differing by at most one element.
inline Range evenPart(int64_t total, int64_t n, int64_t i) {
  const int64_t base = total / n, extra = total % n;
  const int64_t begin = i * base + std::min<int64_t>(i, extra);
  return Range{begin, begin + base + (i < extra ? 1 : 0)};
}

// What one op is, as every rank must agree on it. Every bridge round carries
// it and peers compare it before they use the round's data. Plain integers:
// it travels through shared memory and sockets as is.
struct OpId {
  uint64_t seq = 0;     // number of this collective in the process group (1, 2, ...)
  int32_t type = -1;    // c10d::OpType
  int32_t dtype = -1;   // at::ScalarType, -1 when the op has no tensor
  int64_t bytes = 0;    // the size every rank must pass (the input of rank-symmetric ops)
  int64_t root = -1;    // root rank, -1 when none
  int32_t redop = -1;   // c10d::ReduceOp::RedOpType of reductions, -1 otherwise
  uint32_t stripes = 0; // all_reduce: digest of the stripe weights, 0 for even stripes

  bool sameCall(const OpId& o) const {
    return seq == o.seq && type == o.type && dtype == o.dtype && bytes == o.bytes &&
           root == o.root && redop == o.redop && stripes == o.stripes;
  }
  // "all_reduce(float32, 32 B, SUM)", "broadcast(float32, 32 B, root 0)".
  std::string describe() const;
};
static_assert(sizeof(OpId) == 40, "OpId is a wire format");

// "rank 0 called all_reduce(float32, 32 B, SUM) but rank 1 called broadcast(...)".
std::string mismatchText(int me, const OpId& mine, int peer, const OpId& theirs);
// "tensor sizes differ between ranks in <op>: rank src sends N B to rank dst, which expects M B; ..."
std::string sizeMismatchText(const OpId& id, int src, int dst, int64_t sent, int64_t expected);

// "rank N failed or exited (...) while this rank waited for its <what>; see its
// log ...": a peer gone mid-wait, in the same words from both bridges.
std::string peerGoneText(int peer, const std::string& what);

// The fail-stop state of one process group: after the first error every op
// raises naming it. Shared by the op threads and the bridge.
class FailState {
 public:
  explicit FailState(int rank) : rank_(rank) {}
  bool broken() const { return broken_.load(std::memory_order_acquire); }
  // Records this rank's failure in `op` as the first (unless one is recorded
  // already; the first stays). Returns true if it was the first.
  bool record(const OpId& id, const std::string& op, const std::string& why);
  // Records a failure a peer reported (its text names its rank and op).
  bool adopt(const std::string& peerFirstFailure);
  std::string first() const;
  // The error every op raises once the group is broken.
  [[noreturn]] void raise(const std::string& op) const;

 private:
  int rank_;
  std::atomic<bool> broken_{false};
  mutable std::mutex mu_;
  std::string first_;
};

// When a blocking step must give up. Every wait in the bridges takes one.
struct Deadline {
  Clock::time_point at;
  std::string what;  // the op, for error messages ("allreduce")
  std::chrono::milliseconds timeout;
  const std::atomic<bool>* stop = nullptr;  // set when the backend shuts down
  FailState* fail = nullptr;                // the group's fail-stop state
  OpId id;                                  // the op these waits belong to

  static Deadline after(std::chrono::milliseconds t, std::string what,
                        const std::atomic<bool>* stop, FailState* fail = nullptr,
                        OpId id = OpId{}) {
    return Deadline{Clock::now() + t, std::move(what), t, stop, fail, id};
  }
  bool expired() const { return Clock::now() >= at; }
  // Throws the error every waiting loop raises when it gives up.
  [[noreturn]] void timedOut(const std::string& waitingFor) const;
  // Throws if the deadline passed, the group broke or the backend is shutting down.
  void check(const std::string& waitingFor) const {
    if (fail && fail->broken()) fail->raise(what);
    if (stop && stop->load(std::memory_order_relaxed)) {
      C10_THROW_ERROR(DistBackendError,
                      "kaitian " + what + ": process group was shut down while waiting for " +
                          waitingFor);
    }
    if (expired()) timedOut(waitingFor);
  }
  // Records `why` as the group's first failure (if none yet) and throws it.
  [[noreturn]] void breakGroup(const std::string& why) const;
  // A peer reported the group broken (`first` names its first failure): adopt
  // it (unless this rank has its own already) and throw.
  [[noreturn]] void peerFailed(const std::string& first) const;
};

}  // namespace kaitian
