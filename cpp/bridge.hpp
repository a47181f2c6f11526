// The inter-group bridge interface: host-memory collectives between all ranks.
// Two implementations: shared memory on one host (shm_bridge.cpp) and TCP
// (tcp_bridge.cpp). The backend builds every op from these primitives.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "common.hpp"
#include "host_reduce.hpp"

namespace kaitian {

// A reduction across "source groups". Each group contributes one partial: after
// the intra-group step every rank of group g holds g's partial, and the group's
// ranks share the publishing work (rank i of g owns stripe i of g's partition).
struct ReduceSpec {
  at::Tensor buf;                          // contiguous 1-D host tensor, this rank's partial
  std::vector<Range> stripes;              // per rank: the elements it reduces
  bool gather = true;                      // copy every stripe's result to every rank
  std::vector<std::vector<int>> groups;    // source groups: ranks, in group-rank order
  std::vector<int> groupOf;                // per rank: index into `groups`
  Reducer reducer;
};

// One all-to-all-v exchange: this rank offers one byte blob; rank d receives
// blob[sendOff[d], sendOff[d] + sendLen[d]) into recvPtr[s] of its own call.
struct ExchangeSpec {
  const uint8_t* blob = nullptr;
  int64_t blobLen = 0;
  std::vector<int64_t> sendOff, sendLen;   // per destination rank
  std::vector<uint8_t*> recvPtr;           // per source rank
  std::vector<int64_t> recvLen;            // per source rank
};

// The most bytes of a failure text a bridge forwards to its peers.
constexpr size_t kMaxFailureText = 1024;

// Fail-stop contract: every reduce/exchange/send/recv carries dl.id (and its
// own call or message sequence number) to the peers, which check it before they
// use the data and raise naming both calls when it differs; every length or
// offset read from a peer is checked against what the op expects. After any
// error the backend calls poison(): peers waiting on this rank, and their later
// ops, raise with the first failure's text.
class Bridge {
 public:
  virtual ~Bridge() = default;
  virtual std::string kind() const = 0;
  // Collective reduction; see ReduceSpec. On return buf holds this rank's stripe
  // result (and every stripe when spec.gather).
  virtual void reduce(ReduceSpec& spec, const Deadline& dl) = 0;
  // Collective all-to-all-v; also a barrier (every rank waits for every other).
  virtual void exchange(const ExchangeSpec& spec, const Deadline& dl) = 0;
  // Whether exchange() checks every pair's sizes on every rank (all ranks share
  // one view of the plan). When not, a pair that disagrees is seen only by those
  // two, and ops whose sizes the op identity does not fix check the plan first.
  virtual bool checksEveryPair() const { return false; }
  // Point-to-point; may run concurrently with collectives (other threads).
  virtual void send(int dst, const void* data, int64_t bytes, int tag, const Deadline& dl) = 0;
  // Receives from `src` (or any source when src < 0); returns the source rank.
  virtual int recv(int src, void* data, int64_t bytes, int tag, const Deadline& dl) = 0;
  // Tells every peer that this process group is broken (first failure text);
  // idempotent, callable from any thread, never blocks for long.
  virtual void poison(const std::string& firstFailure) = 0;
  // For the collectives thread while it waits outside the bridge (in its
  // vendor's step, with the ranks `with`): raises, as the bridge's own waits
  // do, when a peer broke the group (and, where the bridge can see the op
  // each peer is in, when one is in another op: shm); returns why one of
  // `with` is gone (it exited, or closed the group), or "" while all are
  // there. Never blocks; cheap enough to call every few milliseconds.
  virtual std::string watchPeers(const std::vector<int>& with, const Deadline& dl, const std::string& what) = 0;
  // Why `peer` is gone (it exited, or closed the group), or "" while it lives;
  // raises, as the waits do, when it broke the group. For a rank waiting
  // outside every op (a benched rank between messages): any thread, never blocks.
  virtual std::string whyGone(int peer, const Deadline& dl, const std::string& what) = 0;
  // Releases OS resources; further calls fail.
  virtual void close() = 0;
};

// Per-chunk reduction helpers shared by both bridges.
namespace detail {
// The rank of group `g` whose publishing stripe contains element `e` of an
// `n`-element buffer, and that stripe.
std::pair<int, Range> ownerOf(const ReduceSpec& spec, int g, int64_t n, int64_t e);
}  // namespace detail

// The part of spec.buf rank `r` publishes for the other source groups'
// reducers: its share of its group's partial. With its own stripe
// (spec.stripes[r]), all of buf that a bridge reads on rank r.
inline Range publishRange(const ReduceSpec& spec, int r) {
  const auto& ranks = spec.groups[spec.groupOf[r]];
  const int64_t idx = std::find(ranks.begin(), ranks.end(), r) - ranks.begin();
  return evenPart(spec.buf.numel(), static_cast<int64_t>(ranks.size()), idx);
}

}  // namespace kaitian
