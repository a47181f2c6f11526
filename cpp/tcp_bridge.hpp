// Bridge over TCP sockets: a full mesh between all ranks (one connection per
// pair for collectives, one for point-to-point), for ranks on different hosts.
// KAITIAN_BRIDGE=tcp forces it on one host.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <functional>
#include <mutex>

#include "bridge.hpp"
#include "tcp_mesh.hpp"

namespace kaitian {

struct TcpFrame;

class TcpBridge : public Bridge {
 public:
  // Builds the mesh of authenticated connections to every peer within `timeout`
  // (see tcp_mesh.hpp: listen address, port range, job key).
  TcpBridge(c10::intrusive_ptr<c10d::Store> store, int rank, int size, const MeshOptions& opts,
            std::chrono::milliseconds timeout);
  ~TcpBridge() override;

  std::string kind() const override { return "tcp"; }
  void reduce(ReduceSpec& spec, const Deadline& dl) override;
  void exchange(const ExchangeSpec& spec, const Deadline& dl) override;
  void send(int dst, const void* data, int64_t bytes, int tag, const Deadline& dl) override;
  int recv(int src, void* data, int64_t bytes, int tag, const Deadline& dl) override;
  void poison(const std::string& firstFailure) override;
  std::string watchPeers(const std::vector<int>& with, const Deadline& dl, const std::string& what) override;
  std::string whyGone(int peer, const Deadline& dl, const std::string& what) override;
  void close() override;

 private:
  struct Transfer {
    int peer;
    uint8_t* ptr;
    int64_t bytes;
    std::function<void()> done = {};  // receives: runs once complete (checks a frame)
    bool frameStart = false;          // sends: the first piece of a frame
    int64_t orig = 0;                 // bytes before the first byte moved
  };
  // Moves every send and receive concurrently (poll), in list order per peer.
  void transfer(std::vector<Transfer> sends, std::vector<Transfer> recvs,
                const std::vector<int>& fds, const Deadline& dl);
  void checkFrame(const TcpFrame& f, int peer, int fd, int32_t kind, uint64_t call,
                  int32_t phase, const Deadline& dl);
  void raiseIfAborted(int peer, int fd, const Deadline& dl);
  void abortChannel(const std::vector<int>& fds, std::mutex& mu, std::vector<char>& clean,
                    bool& aborted);
  int rank_, size_;
  std::vector<int> coll_, p2p_;  // socket per peer (-1 for self)
  std::mutex sendMu_;
  // Data path and fail-stop state (sized on first use).
  std::mutex collMu_;                     // held by transfer(): the collectives thread
  uint64_t calls_ = 0;                    // collective bridge calls, alike on every rank
  std::vector<uint64_t> p2pSent_, p2pRecvd_;  // messages per peer (send / receive thread)
  std::vector<char> collClean_, p2pClean_;    // per peer: outgoing stream at a frame boundary
  bool collAborted_ = false, p2pAborted_ = false;
  std::mutex poisonMu_;
  std::string poisonText_;
};

}  // namespace kaitian
