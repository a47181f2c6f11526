// Bridge over TCP sockets: a full mesh between all ranks (one connection per
// pair for collectives, one for point-to-point), for ranks on different hosts.
// KAITIAN_BRIDGE=tcp forces it on one host.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <mutex>

#include "bridge.hpp"
#include "tcp_mesh.hpp"

namespace kaitian {

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
  void close() override;

 private:
  struct Transfer {
    int peer;
    uint8_t* ptr;
    int64_t bytes;
  };
  // Moves every send and receive concurrently (poll), in list order per peer.
  void transfer(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs,
                const std::vector<int>& fds, const Deadline& dl);
  int rank_, size_;
  std::vector<int> coll_, p2p_;  // socket per peer (-1 for self)
  std::mutex sendMu_;
};

}  // namespace kaitian
