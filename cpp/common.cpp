// Op identities, the fail-stop state and the errors every wait raises.
#include "common.hpp"

#include <cstdio>

#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "compat.hpp"
#include "host_reduce.hpp"

namespace kaitian {

namespace {
// The names users call the ops by (torch.distributed functions).
const char* opTypeName(int32_t type) {
  using c10d::OpType;
  switch (static_cast<OpType>(type)) {
    case OpType::BROADCAST: return "broadcast";
    case OpType::ALLREDUCE: return "all_reduce";
    case OpType::ALLREDUCE_COALESCED: return "all_reduce_coalesced";
    case OpType::REDUCE: return "reduce";
    case OpType::ALLGATHER: return "all_gather";
    case OpType::_ALLGATHER_BASE: return "all_gather_into_tensor";
    case OpType::ALLGATHER_COALESCED: return "all_gather_coalesced";
    case OpType::GATHER: return "gather";
    case OpType::SCATTER: return "scatter";
    case OpType::REDUCE_SCATTER: return "reduce_scatter";
    case OpType::ALLTOALL_BASE: return "all_to_all_single";
    case OpType::ALLTOALL: return "all_to_all";
    case OpType::SEND: return "send";
    case OpType::RECV: return "recv";
    case OpType::RECVANYSOURCE: return "recv";
    case OpType::BARRIER: return "barrier";
    case OpType::_REDUCE_SCATTER_BASE: return "reduce_scatter_tensor";
    case OpType::COALESCED: return "all_gather_into_tensor_coalesced";
    case OpType::_ALLREDUCE_SPARSE: return "all_reduce(sparse)";
#if KAITIAN_TORCH_AT_LEAST(2, 12)  // before, it is COALESCED (compat.hpp)
    case OpType::REDUCE_SCATTER_TENSOR_COALESCED: return "reduce_scatter_tensor_coalesced";
#endif
#if KAITIAN_TORCH_AT_LEAST(2, 14)
    case OpType::ALLGATHER_INTO_TENSOR_COALESCED: return "all_gather_into_tensor_coalesced";
#endif
    default: return "unknown op";
  }
}

std::string dtypeName(int32_t dtype) {
  if (dtype < 0 || dtype >= static_cast<int32_t>(c10::ScalarType::NumOptions)) return "?";
  std::string s = c10::toString(static_cast<c10::ScalarType>(dtype));
  // "Float" -> "float32" as torch prints dtypes
  static const std::pair<const char*, const char*> names[] = {
      {"Float", "float32"}, {"Double", "float64"}, {"Half", "float16"}, {"BFloat16", "bfloat16"},
      {"Int", "int32"},     {"Long", "int64"},     {"Short", "int16"},  {"Char", "int8"},
      {"Byte", "uint8"},    {"Bool", "bool"},      {"ComplexFloat", "complex64"},
      {"ComplexDouble", "complex128"}};
  for (const auto& [from, to] : names) {
    if (s == from) return to;
  }
  return s;
}
}  // namespace

std::string OpId::describe() const {
  std::string s = opTypeName(type);
  if (type == static_cast<int32_t>(c10d::OpType::BARRIER)) return s + "()";
  s += "(" + dtypeName(dtype);
  if (bytes >= 0) s += ", " + std::to_string(bytes) + " B";  // -1: sizes may differ by rank
  if (root >= 0) {
    const char* what = type == static_cast<int32_t>(c10d::OpType::SEND)   ? ", to rank "
                       : type == static_cast<int32_t>(c10d::OpType::RECV) ? ", from rank "
                                                                           : ", root ";
    s += what + std::to_string(root);
  }
  if (redop >= 0) {
    s += std::string(", ") + reduceOpName(static_cast<c10d::ReduceOp::RedOpType>(redop));
  }
  if (stripes != 0) {
    char digest[16];
    std::snprintf(digest, sizeof(digest), "%08x", stripes);
    s += std::string(", stripe weights #") + digest;
  }
  return s + ")";
}

std::string mismatchText(int me, const OpId& mine, int peer, const OpId& theirs) {
  std::string a = "rank " + std::to_string(me) + " called " + mine.describe();
  std::string b = "rank " + std::to_string(peer) + " called " + theirs.describe();
  if (mine.seq != theirs.seq) {
    a += " as collective #" + std::to_string(mine.seq);
    b += " as collective #" + std::to_string(theirs.seq);
  }
  const bool meFirst = me < peer;
  return "ranks issued different collectives: " + (meFirst ? a : b) + " but " + (meFirst ? b : a) +
         "; every rank must call the same collectives in the same order with the same "
         "dtype, size and root";
}

std::string peerGoneText(int peer, const std::string& what) {
  // A peer's script that raised closes its group at exit, as one that ended or
  // destroyed it does: the peer's log tells which.
  const std::string r = "rank " + std::to_string(peer);
  return r + " failed or exited (or destroyed its process group) while this rank waited for its " +
         what + "; see " + r + "'s log for its error; if it ended normally, ranks issued "
         "different numbers of collectives";
}

std::string sizeMismatchText(const OpId& id, int src, int dst, int64_t sent, int64_t expected) {
  return "tensor sizes differ between ranks in " + id.describe() + ": rank " + std::to_string(src) +
         " sends " + std::to_string(sent) + " B to rank " + std::to_string(dst) + ", which expects " +
         std::to_string(expected) + " B; every rank must pass matching shapes/split sizes";
}

bool FailState::record(const OpId& id, const std::string& op, const std::string& why) {
  std::string who = "rank " + std::to_string(rank_) + "'s ";
  who += id.type >= 0 ? id.describe() : op;
  if (id.seq > 0) who += " (collective #" + std::to_string(id.seq) + ")";
  return adopt(who + " failed: " + why);
}

bool FailState::adopt(const std::string& firstFailure) {
  std::lock_guard<std::mutex> lock(mu_);
  if (broken_.load(std::memory_order_relaxed)) return false;
  first_ = firstFailure;
  broken_.store(true, std::memory_order_release);
  return true;
}

std::string FailState::first() const {
  std::lock_guard<std::mutex> lock(mu_);
  return first_;
}

void FailState::raise(const std::string& op) const {
  C10_THROW_ERROR(DistBackendError,
                  "kaitian " + op + ": the process group is broken: " + first() +
                      " -- destroy it and create a new one (kaitianrun --max-restarts restarts "
                      "the job)");
}

void Deadline::timedOut(const std::string& waitingFor) const {
  char secs[32];
  std::snprintf(secs, sizeof(secs), "%.1f", timeout.count() / 1000.0);
  breakGroup("timed out after " + std::string(secs) + " s waiting for " + waitingFor +
             " (a peer died, is stuck, or ranks issued different collectives; raise the "
             "process group timeout if the peer is only slow)");
}

void Deadline::breakGroup(const std::string& why) const {
  // Names the op so that peers learning of it know which call failed first.
  if (fail) fail->record(id, what, why);
  C10_THROW_ERROR(DistBackendError, "kaitian " + what + ": " + why);
}

void Deadline::peerFailed(const std::string& first) const {
  if (fail) {
    fail->adopt(first);
    fail->raise(what);
  }
  C10_THROW_ERROR(DistBackendError,
                  "kaitian " + what + ": the process group is broken: " + first);
}

}  // namespace kaitian
