// Setting up the TCP bridge's full mesh: who may join and how.
//
// Every rank listens (on a free port of KAITIAN_BRIDGE_PORTS when given),
// publishes its address through the store, connects to every lower rank and
// accepts every higher one, two channels per pair. All of it runs in one poll
// loop under the group's deadline, one small state machine per connection, so
// a connection that stalls, speaks garbage or fails to authenticate is dropped
// (and logged) without holding up or failing the real ranks.
//
// Both sides prove they hold the job key with HMAC-SHA256 over both nonces,
// both ranks, the channel, the world size, the protocol version and the group
// instance's session token:
//   server -> client  challenge: magic, version, size, server rank, server nonce
//   client -> server  hello:     magic, version, size, client rank, channel,
//                                client nonce, HMAC(key, "client" || transcript)
//   server -> client  welcome:   HMAC(key, "server" || transcript)
// The server only answers a client that proved itself; a client only uses a
// connection whose server proved itself.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace kaitian {

// Bump when the wire format of the handshake or of the TCP bridge's data
// (tcp_bridge.cpp) changes: ranks of different versions then refuse each other.
constexpr uint32_t kTcpProtocolVersion = 2;  // 2: every message framed (fail-stop identity)

struct MeshOptions {
  std::string host;     // IPv4 address to listen on and advertise
  std::string key;      // the job key peers must prove they hold
  std::string session;  // this group instance's token (binds proofs to it)
  int portLo = 0;       // listen on the first free port of [portLo, portHi]; 0 = any
  int portHi = 0;
};

struct Mesh {
  std::vector<int> coll, p2p;  // non-blocking socket per peer and channel (-1 for self)
};

// Builds the mesh within `timeout`; throws a one-line error naming what is missing.
Mesh connectMesh(c10d::Store& store, int rank, int size, const MeshOptions& opts,
                 std::chrono::milliseconds timeout);

}  // namespace kaitian
