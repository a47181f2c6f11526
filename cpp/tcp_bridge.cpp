// TCP bridge. Every transfer is non-blocking and multiplexed with poll(), so a
// rank can send to and receive from all peers at once without deadlocking, and
// every wait honours the deadline. A closed socket means the peer died.
#include "tcp_bridge.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <thread>

namespace kaitian {

namespace {

struct P2PHeader {
  int64_t tag;
  int64_t bytes;
};

std::string errnoText() { return std::strerror(errno); }

int pollTimeoutMs(const Deadline& dl) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(dl.at - Clock::now());
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(left.count(), 100)));
}

// Blocking-style full read/write on a non-blocking socket, with the deadline.
void ioAll(int fd, uint8_t* p, int64_t n, bool isSend, int peer, const Deadline& dl) {
  while (n > 0) {
    const ssize_t k = isSend ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (k > 0) {
      p += k;
      n -= k;
      continue;
    }
    if (k == 0 && !isSend) {
      C10_THROW_ERROR(DistBackendError, "kaitian " + dl.what + ": rank " + std::to_string(peer) +
                                            " closed its connection (it exited or crashed)");
    }
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      C10_THROW_ERROR(DistBackendError, "kaitian " + dl.what + ": connection to rank " +
                                            std::to_string(peer) + " failed: " + errnoText() +
                                            " (it exited or crashed?)");
    }
    struct pollfd pfd{fd, static_cast<short>(isSend ? POLLOUT : POLLIN), 0};
    ::poll(&pfd, 1, pollTimeoutMs(dl));
    dl.check("rank " + std::to_string(peer));
  }
}

}  // namespace

TcpBridge::TcpBridge(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                     const MeshOptions& opts, std::chrono::milliseconds timeout)
    : rank_(rank), size_(size) {
  Mesh mesh = connectMesh(*store, rank, size, opts, timeout);
  coll_ = std::move(mesh.coll);
  p2p_ = std::move(mesh.p2p);
}

TcpBridge::~TcpBridge() { close(); }

void TcpBridge::close() {
  for (auto* v : {&coll_, &p2p_}) {
    for (int& fd : *v) {
      if (fd >= 0) {
        ::shutdown(fd, SHUT_RDWR);
        ::close(fd);
      }
      fd = -1;
    }
  }
}

void TcpBridge::transfer(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs,
                         const std::vector<int>& fds, const Deadline& dl) {
  std::vector<std::deque<Transfer>> out(size_), in(size_);
  for (const auto& t : sends) if (t.bytes > 0) out[t.peer].push_back(t);
  for (const auto& t : recvs) if (t.bytes > 0) in[t.peer].push_back(t);
  std::vector<struct pollfd> pfds;
  std::vector<int> peerOf;
  while (true) {
    pfds.clear();
    peerOf.clear();
    for (int p = 0; p < size_; ++p) {
      short ev = 0;
      if (!out[p].empty()) ev |= POLLOUT;
      if (!in[p].empty()) ev |= POLLIN;
      if (ev) {
        TORCH_CHECK(fds[p] >= 0, "kaitian ", dl.what, ": the TCP bridge is closed");
        pfds.push_back({fds[p], ev, 0});
        peerOf.push_back(p);
      }
    }
    if (pfds.empty()) return;
    ::poll(pfds.data(), pfds.size(), pollTimeoutMs(dl));
    for (size_t i = 0; i < pfds.size(); ++i) {
      const int p = peerOf[i];
      if (pfds[i].revents & (POLLOUT | POLLERR | POLLHUP)) {
        while (!out[p].empty()) {
          auto& t = out[p].front();
          const ssize_t k = ::send(fds[p], t.ptr, t.bytes, MSG_NOSIGNAL);
          if (k < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
            C10_THROW_ERROR(DistBackendError, "kaitian " + dl.what + ": sending to rank " +
                                                  std::to_string(p) + " failed: " + errnoText() +
                                                  " (did it exit?)");
          }
          t.ptr += k;
          t.bytes -= k;
          if (t.bytes == 0) out[p].pop_front();
        }
      }
      if (pfds[i].revents & (POLLIN | POLLERR | POLLHUP)) {
        while (!in[p].empty()) {
          auto& t = in[p].front();
          const ssize_t k = ::recv(fds[p], t.ptr, t.bytes, 0);
          if (k == 0) {
            C10_THROW_ERROR(DistBackendError, "kaitian " + dl.what + ": rank " +
                                                  std::to_string(p) +
                                                  " closed its connection (it exited or crashed)");
          }
          if (k < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
            C10_THROW_ERROR(DistBackendError, "kaitian " + dl.what + ": receiving from rank " +
                                                  std::to_string(p) + " failed: " + errnoText() +
                                                  " (it exited or crashed?)");
          }
          t.ptr += k;
          t.bytes -= k;
          if (t.bytes == 0) in[p].pop_front();
        }
      }
    }
    bool busy = false;
    for (int p = 0; p < size_ && !busy; ++p) busy = !out[p].empty() || !in[p].empty();
    if (!busy) return;
    dl.check("the other ranks over TCP");
  }
}

void TcpBridge::reduce(ReduceSpec& spec, const Deadline& dl) {
  const int64_t n = spec.buf.numel();
  const int64_t es = static_cast<int64_t>(spec.buf.element_size());
  auto* base = static_cast<uint8_t*>(spec.buf.data_ptr());
  const int myG = spec.groupOf[rank_];
  auto pubRange = [&](int r) {
    const auto& g = spec.groups[spec.groupOf[r]];
    const int64_t idx = std::find(g.begin(), g.end(), r) - g.begin();
    return evenPart(n, static_cast<int64_t>(g.size()), idx);
  };
  const Range mine = spec.stripes[rank_];
  const Range myPub = pubRange(rank_);
  std::vector<Transfer> sends, recvs;
  for (int s = 0; s < size_; ++s) {
    if (s == rank_ || spec.groupOf[s] == myG) continue;
    const Range r = myPub.intersect(spec.stripes[s]);
    sends.push_back({s, base + r.begin * es, r.size() * es});
  }
  // One temporary per other source group, filled by that group's owners.
  const int G = static_cast<int>(spec.groups.size());
  at::Tensor temps = at::empty({std::max(G - 1, 0), mine.size()}, spec.buf.options());
  std::vector<const void*> srcs{base + mine.begin * es};
  int row = 0;
  for (int g = 0; g < G; ++g) {
    if (g == myG) continue;
    auto* t = static_cast<uint8_t*>(temps.data_ptr()) + row * mine.size() * es;
    srcs.push_back(t);
    ++row;
    for (int o : spec.groups[g]) {
      const Range r = pubRange(o).intersect(mine);
      recvs.push_back({o, t + (r.begin - mine.begin) * es, r.size() * es});
    }
  }
  transfer(sends, recvs, coll_, dl);
  spec.reducer(srcs, mine.size(), base + mine.begin * es, nullptr);
  if (spec.gather) {
    sends.clear();
    recvs.clear();
    for (int s = 0; s < size_; ++s) {
      if (s == rank_) continue;
      sends.push_back({s, base + mine.begin * es, mine.size() * es});
      const Range r = spec.stripes[s];
      recvs.push_back({s, base + r.begin * es, r.size() * es});
    }
    transfer(sends, recvs, coll_, dl);
  }
}

void TcpBridge::exchange(const ExchangeSpec& spec, const Deadline& dl) {
  // Lengths first (also makes this a barrier), then the data.
  std::vector<int64_t> announced(size_, 0), mine(spec.sendLen);
  std::vector<Transfer> sends, recvs;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    sends.push_back({p, reinterpret_cast<uint8_t*>(&mine[p]), 8});
    recvs.push_back({p, reinterpret_cast<uint8_t*>(&announced[p]), 8});
  }
  transfer(sends, recvs, coll_, dl);
  sends.clear();
  recvs.clear();
  std::string mismatch;
  std::vector<at::Tensor> scratch;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    sends.push_back({p, const_cast<uint8_t*>(spec.blob) + spec.sendOff[p], spec.sendLen[p]});
    if (announced[p] == spec.recvLen[p]) {
      recvs.push_back({p, spec.recvPtr[p], spec.recvLen[p]});
    } else {
      if (mismatch.empty()) {
        mismatch = "rank " + std::to_string(p) + " sends " + std::to_string(announced[p]) +
                   " bytes, this rank expects " + std::to_string(spec.recvLen[p]);
      }
      scratch.push_back(at::empty({announced[p]}, at::kByte));
      recvs.push_back({p, static_cast<uint8_t*>(scratch.back().data_ptr()), announced[p]});
    }
  }
  transfer(sends, recvs, coll_, dl);
  TORCH_CHECK(mismatch.empty(), "kaitian ", dl.what, ": tensor sizes differ between ranks: ",
              mismatch, "; every rank must pass matching shapes/split sizes");
  if (spec.sendLen[rank_] > 0 && spec.recvPtr[rank_] != spec.blob + spec.sendOff[rank_]) {
    std::memmove(spec.recvPtr[rank_], spec.blob + spec.sendOff[rank_], spec.sendLen[rank_]);
  }
}

void TcpBridge::send(int dst, const void* data, int64_t bytes, int tag, const Deadline& dl) {
  TORCH_CHECK(dst != rank_, "kaitian send: sending to yourself is not supported over TCP");
  TORCH_CHECK(p2p_[dst] >= 0, "kaitian send: the TCP bridge is closed");
  std::lock_guard<std::mutex> lock(sendMu_);
  P2PHeader h{tag, bytes};
  ioAll(p2p_[dst], reinterpret_cast<uint8_t*>(&h), sizeof(h), true, dst, dl);
  ioAll(p2p_[dst], static_cast<uint8_t*>(const_cast<void*>(data)), bytes, true, dst, dl);
}

int TcpBridge::recv(int src, void* data, int64_t bytes, int tag, const Deadline& dl) {
  TORCH_CHECK(src != rank_, "kaitian recv: receiving from yourself is not supported over TCP");
  while (src < 0) {
    std::vector<struct pollfd> pfds;
    std::vector<int> peers;
    for (int p = 0; p < size_; ++p) {
      if (p != rank_ && p2p_[p] >= 0) {
        pfds.push_back({p2p_[p], POLLIN, 0});
        peers.push_back(p);
      }
    }
    ::poll(pfds.data(), pfds.size(), pollTimeoutMs(dl));
    for (size_t i = 0; i < pfds.size() && src < 0; ++i) {
      if (pfds[i].revents) src = peers[i];
    }
    if (src < 0) dl.check("a message from any rank");
  }
  TORCH_CHECK(p2p_[src] >= 0, "kaitian recv: the TCP bridge is closed");
  P2PHeader h{};
  ioAll(p2p_[src], reinterpret_cast<uint8_t*>(&h), sizeof(h), false, src, dl);
  TORCH_CHECK(h.tag == tag, "kaitian recv: the next message from rank ", src, " has tag ", h.tag,
              " but recv expects tag ", tag,
              "; kaitian delivers messages between two ranks in order");
  TORCH_CHECK(h.bytes == bytes, "kaitian recv: rank ", src, " sent ", h.bytes,
              " bytes but the receive tensor holds ", bytes, " bytes");
  ioAll(p2p_[src], static_cast<uint8_t*>(data), bytes, false, src, dl);
  return src;
}

}  // namespace kaitian
