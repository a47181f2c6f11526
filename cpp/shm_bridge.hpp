// Same-host bridge over POSIX shared memory. Each rank owns one segment: a
// header (counters, event words, heartbeat, fail-stop state, the identity of
// every chunk slot and mailbox), kSlots chunk slots for collectives and a p2p
// mailbox area of about one chunk split between the peers, so a rank's segment
// is O(chunk) whatever the world size. Every rank maps every peer's segment
// (lazily: only the pages it reads are faulted in). Segments are unlinked as
// soon as every peer has mapped them.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#include "bridge.hpp"

namespace kaitian {

struct ShmSegmentHeader;
struct ShmEventWord;

// The shared-memory bridge's options (the TCP bridge's are MeshOptions).
struct ShmBridgeOptions {
  c10::intrusive_ptr<c10d::Store> store;  // where peers meet (a FileStore in the run directory)
  // This rank's segment name, unique and unguessable per process group
  // instance (it carries the pid so a later start can collect it if this
  // process is killed before unlinking).
  std::string name;
  int64_t chunkBytes = 1 << 20;
  // Per rank: its pid when it shares our pid namespace, else -1 (its heartbeat
  // tells whether it lives).
  std::vector<int64_t> pids;
  int64_t spinMicros = 50;  // spin before sleeping on a futex (KAITIAN_SPIN_US)
};

class ShmBridge : public Bridge {
 public:
  ShmBridge(int rank, int size, ShmBridgeOptions options, std::chrono::milliseconds timeout);
  ~ShmBridge() override;

  std::string kind() const override { return "shm"; }
  bool checksEveryPair() const override { return true; }
  void reduce(ReduceSpec& spec, const Deadline& dl) override;
  void exchange(const ExchangeSpec& spec, const Deadline& dl) override;
  void send(int dst, const void* data, int64_t bytes, int tag, const Deadline& dl) override;
  int recv(int src, void* data, int64_t bytes, int tag, const Deadline& dl) override;
  void poison(const std::string& firstFailure) override;
  std::string watchPeers(const std::vector<int>& with, const Deadline& dl, const std::string& what) override;
  std::string whyGone(int peer, const Deadline& dl, const std::string& what) override;
  void close() override;

  // Bytes of one rank's segment for this world size and chunk (for docs/bench).
  static int64_t segmentBytes(int size, int64_t chunkBytes);

 private:
  struct Peer {
    uint8_t* base = nullptr;
    ShmSegmentHeader* hdr = nullptr;
  };
  struct Beat {  // the last heartbeat value seen from a peer, and when
    uint64_t value = 0;
    Clock::time_point seen;
  };
  enum Kind : int32_t { kReduce = 1, kExchange = 2 };

  uint8_t* inArea(int r, uint64_t round) const;
  uint8_t* outArea(int r, uint64_t round) const;
  uint8_t* mailbox(int owner, int dst) const;
  std::atomic<uint64_t>& p2pSent(int owner, int dst) const;
  std::atomic<uint64_t>& p2pAck(int owner, int src) const;
  void signal();
  void ring(int r);  // wakes rank r's p2p waiters
  // Waits until `ready()` holds, sleeping on `ev`; between sleeps checks the
  // deadline, the peers' fail-stop state and the liveness of `watch` (a rank,
  // or -1 for every peer).
  template <typename Ready>
  void waitUntil(Ready ready, ShmEventWord& ev, int watch, const Deadline& dl, const char* what);
  void waitAtLeast(int peer, const std::atomic<uint64_t>& ctr, uint64_t target,
                   const Deadline& dl, const char* what);
  // Each peer's fail-stop state, read before the data it guards (see waitUntil).
  std::vector<uint32_t> peerStates() const;
  void checkPeers(const std::vector<uint32_t>& states, int watch, const Deadline& dl, const char* what);
  // Why `peer` is gone (exited, or stopped its heartbeat), or "" while it lives.
  std::string goneText(int peer, const char* what);
  std::string failureOf(int peer) const;
  // The collective this rank is in (collectives thread only), and a peer's:
  // false while it has none or is rewriting it.
  void publishOp(const OpId& id);
  bool peerOp(int peer, OpId& out) const;
  // Collective calls: identity of each round, checked by the readers.
  void beginCall(const Deadline& dl);
  void publishRound(uint64_t t, Kind kind, const Deadline& dl);
  void checkRound(int peer, uint64_t t, Kind kind, const Deadline& dl);
  // Waits until every peer is done with round t's slot's previous use.
  void awaitSlot(uint64_t t, const Deadline& dl);
  uint64_t beginRound(const Deadline& dl);
  void endRound(uint64_t t);
  void heartbeatLoop();

  int rank_, size_;
  int64_t chunk_, mailbox_;
  size_t segBytes_, dataOff_;
  std::vector<int64_t> pids_;
  std::vector<Peer> peers_;
  std::string myName_;
  bool unlinked_ = false;
  uint64_t round_ = 0;  // collective rounds done; identical on every rank
  uint64_t calls_ = 0;  // collective bridge calls done; identical on every rank
  uint64_t publishedSeq_ = 0;  // the collective last published in our header
  int64_t spinMicros_;  // spin before sleeping on a futex (KAITIAN_SPIN_US)
  bool oversubscribed_;  // more ranks on this host than cores we may use: yield, do not spin
  std::chrono::milliseconds deadAfter_;  // a heartbeat this old means dead
  std::mutex beatMu_;
  std::vector<Beat> beats_;
  std::atomic<bool> poisoned_{false};
  // The heartbeat thread (a counter in our header, bumped every 100 ms).
  std::mutex hbMu_;
  std::condition_variable hbCv_;
  bool hbStop_ = false;
  std::thread hbThread_;
};

}  // namespace kaitian
