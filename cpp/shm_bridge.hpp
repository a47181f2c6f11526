// Same-host bridge over POSIX shared memory. Each rank owns one segment (control
// counters, two double-buffered chunk slots, one mailbox per peer) and maps every
// peer's segment. Segments are unlinked as soon as every peer has mapped them.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>

#include "bridge.hpp"

namespace kaitian {

struct ShmSegmentHeader;

class ShmBridge : public Bridge {
 public:
  // `store` is where peers meet (a FileStore in the run directory); `name` is this
  // rank's segment name, unique per process group instance (it carries the pid so
  // a later start can collect it if this process is killed before unlinking); `pids[r]` is rank r's pid when it
  // shares our pid namespace (else -1), used to report a dead peer early.
  ShmBridge(c10::intrusive_ptr<c10d::Store> store, int rank, int size, const std::string& name,
            int64_t chunkBytes, std::vector<int64_t> pids, std::chrono::milliseconds timeout,
            int64_t spinMicros);
  ~ShmBridge() override;

  std::string kind() const override { return "shm"; }
  void reduce(ReduceSpec& spec, const Deadline& dl) override;
  void exchange(const ExchangeSpec& spec, const Deadline& dl) override;
  void send(int dst, const void* data, int64_t bytes, int tag, const Deadline& dl) override;
  int recv(int src, void* data, int64_t bytes, int tag, const Deadline& dl) override;
  std::vector<std::pair<uintptr_t, int64_t>> regions() const override;
  void close() override;

 private:
  struct Peer {
    uint8_t* base = nullptr;
    ShmSegmentHeader* hdr = nullptr;
  };
  uint8_t* inArea(int r, uint64_t round) const;
  uint8_t* outArea(int r, uint64_t round) const;
  uint8_t* mailbox(int owner, int dst) const;
  std::atomic<uint64_t>& p2pSent(int owner, int dst) const;
  std::atomic<uint64_t>& p2pAck(int owner, int src) const;
  void signal();
  void waitAtLeast(int peer, const std::atomic<uint64_t>& ctr, uint64_t target,
                   const Deadline& dl, const char* what);
  void checkPeerAlive(int peer, const Deadline& dl, const char* what);
  uint64_t beginRound(const Deadline& dl);
  void endRound(uint64_t t);

  int rank_, size_;
  int64_t chunk_, mailbox_;
  size_t segBytes_, dataOff_;
  std::vector<int64_t> pids_;
  std::vector<Peer> peers_;
  std::string myName_;
  bool unlinked_ = false;
  uint64_t round_ = 0;  // collective rounds done; identical on every rank
  int64_t spinMicros_;  // spin before sleeping on a futex (KAITIAN_SPIN_US)
};

}  // namespace kaitian
