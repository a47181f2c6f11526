// TCP bridge. Every transfer is non-blocking and multiplexed with poll(), so a
// rank can send to and receive from all peers at once without deadlocking, and
// every wait honours the deadline. A closed socket means the peer died.
#include "tcp_bridge.hpp"
#include <ATen/ops/empty.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <thread>

namespace kaitian {

// Every message on a bridge socket starts with a frame header: the receiver
// checks it (identity, sequence, length) before it reads the payload.
constexpr uint64_t kFrameMagic = 0x3146524b54494b41ULL;  // "AKITKRF1"
enum TcpFrameKind : int32_t { kData = 1, kP2P = 2, kAbort = 3 };
struct TcpFrame {
  uint64_t magic;
  int32_t kind;
  int32_t phase;   // collectives: 0 exchange, 1 reduce scatter, 2 reduce gather
  uint64_t call;   // collective bridge call / point-to-point message number
  int64_t len;     // payload bytes that follow
  int64_t other;   // exchange: bytes the sender expects back; p2p: the tag
  OpId id;
};
static_assert(sizeof(TcpFrame) == 80, "Frame is a wire format");

namespace {
using Frame = TcpFrame;


std::string errnoText() { return std::strerror(errno); }
// The last socket error says the peer's end is gone (it exited or closed its group).
bool peerGone() { return errno == EPIPE || errno == ECONNRESET; }

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

// Moves every send and receive concurrently (poll), in list order per peer. A
// receive's `done` runs as soon as it completed (it checks a frame header
// before the payload behind it is read). On return or throw, records which
// peers' outgoing streams stand at a frame boundary (see poison()).
void TcpBridge::transfer(std::vector<Transfer> sends, std::vector<Transfer> recvs,
                         const std::vector<int>& fds, const Deadline& dl) {
  std::lock_guard<std::mutex> lock(collMu_);
  if (collClean_.empty()) collClean_.assign(size_, 1);
  std::vector<std::deque<Transfer>> out(size_), in(size_);
  for (auto& t : sends) {
    if (t.bytes > 0) {
      t.orig = t.bytes;
      out[t.peer].push_back(std::move(t));
    }
  }
  for (auto& t : recvs) {
    if (t.bytes > 0) {
      t.orig = t.bytes;
      in[t.peer].push_back(std::move(t));
    }
  }
  struct Boundary {  // runs however transfer() exits
    TcpBridge* self;
    std::vector<std::deque<Transfer>>& out;
    ~Boundary() {
      for (int p = 0; p < self->size_; ++p) {
        const auto& q = out[p];
        self->collClean_[p] = q.empty() || (q.front().frameStart && q.front().bytes == q.front().orig);
      }
    }
  } boundary{this, out};
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
            const int sendErrno = errno;
            // A peer whose group broke sends why, then closes: its reason may be
            // waiting where this rank's next frame header would be read.
            const bool atHeader = in[p].empty() || (in[p].front().done && in[p].front().bytes == in[p].front().orig);
            if (atHeader) raiseIfAborted(p, fds[p], dl);
            errno = sendErrno;
            if (peerGone()) dl.breakGroup(peerGoneText(p, "data") + " (sending: " + errnoText() + ")");
            dl.breakGroup("sending to rank " + std::to_string(p) + " failed: " + errnoText() +
                          " (it exited, crashed, or its process group broke)");
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
          if (k == 0) dl.breakGroup(peerGoneText(p, "data") + " (it closed its connection)");
          if (k < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
            if (peerGone()) dl.breakGroup(peerGoneText(p, "data") + " (" + errnoText() + ")");
            dl.breakGroup("receiving from rank " + std::to_string(p) + " failed: " +
                          errnoText() + " (it exited or crashed?)");
          }
          t.ptr += k;
          t.bytes -= k;
          if (t.bytes == 0) {
            if (t.done) t.done();
            in[p].pop_front();
          }
        }
      }
    }
    bool busy = false;
    for (int p = 0; p < size_ && !busy; ++p) busy = !out[p].empty() || !in[p].empty();
    if (!busy) return;
    dl.check("the other ranks over TCP");
  }
}

void TcpBridge::checkFrame(const Frame& f, int peer, int fd, int32_t kind, uint64_t call,
                           int32_t phase, const Deadline& dl) {
  const std::string from = "rank " + std::to_string(peer);
  if (f.magic != kFrameMagic) {
    dl.breakGroup(from + " sent bytes that are not a kaitian frame (protocol error)");
  }
  if (f.kind == kAbort) {
    // The peer's group broke; its first failure follows (bounded).
    if (f.len < 0 || f.len > static_cast<int64_t>(kMaxFailureText)) {
      dl.breakGroup(from + " sent an abort frame of " + std::to_string(f.len) + " bytes");
    }
    std::string text(static_cast<size_t>(f.len), '\0');
    try {
      auto quick = dl;
      quick.at = std::min(dl.at, Clock::now() + std::chrono::seconds(2));
      quick.fail = nullptr;
      ioAll(fd, reinterpret_cast<uint8_t*>(text.data()), f.len, false, peer, quick);
    } catch (const std::exception&) {
      text = from + " reported an error";
    }
    for (auto& c : text) if (c < 32 || c > 126) c = '?';
    dl.peerFailed(text);
  }
  if (f.kind != kind) {
    dl.breakGroup(from + " sent a " + (f.kind == kP2P ? "point-to-point" : "collective") +
                  " frame on the " + (kind == kP2P ? "point-to-point" : "collective") +
                  " connection (protocol error)");
  }
  if (kind == kData) {
    if (!f.id.sameCall(dl.id)) dl.breakGroup(mismatchText(rank_, dl.id, peer, f.id));
    if (f.call != call || f.phase != phase) {
      dl.breakGroup(from + " is at bridge call " + std::to_string(f.call) + " phase " +
                    std::to_string(f.phase) + " but this rank at call " + std::to_string(call) +
                    " phase " + std::to_string(phase) + " of " + dl.id.describe() +
                    " (the ranks' op sequences diverged)");
    }
  }
}

namespace {
Frame dataFrame(int32_t phase, uint64_t call, int64_t len, int64_t other, const OpId& id) {
  return Frame{kFrameMagic, kData, phase, call, len, other, id};
}
}  // namespace

void TcpBridge::reduce(ReduceSpec& spec, const Deadline& dl) {
  if (dl.fail && dl.fail->broken()) dl.fail->raise(dl.what);
  const uint64_t call = ++calls_;
  const int64_t es = static_cast<int64_t>(spec.buf.element_size());
  auto* base = static_cast<uint8_t*>(spec.buf.data_ptr());
  const int myG = spec.groupOf[rank_];
  auto pubRange = [&](int r) { return publishRange(spec, r); };
  const Range mine = spec.stripes[rank_];
  const Range myPub = pubRange(rank_);
  // One temporary per other source group, filled by that group's owners.
  const int G = static_cast<int>(spec.groups.size());
  at::Tensor temps = at::empty({std::max(G - 1, 0), mine.size()}, spec.buf.options());
  std::vector<const void*> srcs{base + mine.begin * es};
  std::vector<uint8_t*> into(size_, nullptr);  // where owner o's piece of our stripe goes
  std::vector<int64_t> fromLen(size_, 0);
  int row = 0;
  for (int g = 0; g < G; ++g) {
    if (g == myG) continue;
    auto* t = static_cast<uint8_t*>(temps.data_ptr()) + row * mine.size() * es;
    srcs.push_back(t);
    ++row;
    for (int o : spec.groups[g]) {
      const Range r = pubRange(o).intersect(mine);
      into[o] = t + (r.begin - mine.begin) * es;
      fromLen[o] = r.size() * es;
    }
  }
  // Phase 1: every peer gets a frame (so every rank checks every rank's call),
  // with the part of our partial that its stripe needs.
  std::vector<Frame> outF(size_), inF(size_);
  std::vector<Transfer> sends, recvs;
  auto frames = [&](int32_t phase, auto sendOf, auto recvOf) {
    sends.clear();
    recvs.clear();
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      auto [sp, sl] = sendOf(p);
      auto [rp, rl] = recvOf(p);
      outF[p] = dataFrame(phase, call, sl, 0, dl.id);
      sends.push_back({p, reinterpret_cast<uint8_t*>(&outF[p]), sizeof(Frame), {}, true});
      sends.push_back({p, sp, sl});
      const int fd = coll_[p];
      const int64_t want = rl;
      recvs.push_back({p, reinterpret_cast<uint8_t*>(&inF[p]), sizeof(Frame),
                       [this, &inF, p, fd, call, phase, want, &dl] {
                         checkFrame(inF[p], p, fd, kData, call, phase, dl);
                         if (inF[p].len != want) {
                           dl.breakGroup("rank " + std::to_string(p) + " announced " +
                                         std::to_string(inF[p].len) + " B where " +
                                         std::to_string(want) + " B of " + dl.id.describe() +
                                         " were due (protocol error)");
                         }
                       }});
      recvs.push_back({p, rp, rl});
    }
    transfer(std::move(sends), std::move(recvs), coll_, dl);
  };
  using Piece = std::pair<uint8_t*, int64_t>;
  frames(
      1,
      [&](int p) -> Piece {
        if (spec.groupOf[p] == myG) return {nullptr, 0};
        const Range r = myPub.intersect(spec.stripes[p]);
        return {base + r.begin * es, r.size() * es};
      },
      [&](int p) -> Piece { return {into[p], fromLen[p]}; });
  spec.reducer(srcs, mine.size(), base + mine.begin * es, nullptr);
  if (spec.gather) {
    frames(
        2, [&](int) -> Piece { return {base + mine.begin * es, mine.size() * es}; },
        [&](int p) -> Piece {
          const Range r = spec.stripes[p];
          return {base + r.begin * es, r.size() * es};
        });
  }
}

void TcpBridge::exchange(const ExchangeSpec& spec, const Deadline& dl) {
  if (dl.fail && dl.fail->broken()) dl.fail->raise(dl.what);
  const uint64_t call = ++calls_;
  // One frame per peer: what we send it (and what we expect back), then the data.
  std::vector<Frame> outF(size_), inF(size_);
  std::vector<Transfer> sends, recvs;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    outF[p] = dataFrame(0, call, spec.sendLen[p], spec.recvLen[p], dl.id);
    sends.push_back({p, reinterpret_cast<uint8_t*>(&outF[p]), sizeof(Frame), {}, true});
    sends.push_back({p, const_cast<uint8_t*>(spec.blob) + spec.sendOff[p], spec.sendLen[p]});
    const int fd = coll_[p];
    recvs.push_back({p, reinterpret_cast<uint8_t*>(&inF[p]), sizeof(Frame),
                     [this, &inF, &spec, p, fd, call, &dl] {
                       checkFrame(inF[p], p, fd, kData, call, 0, dl);
                       const Frame& f = inF[p];
                       auto sizes = [&](int s, int d, int64_t sent, int64_t expected) {
                         dl.breakGroup(sizeMismatchText(dl.id, s, d, sent, expected));
                       };
                       if (f.len != spec.recvLen[p]) sizes(p, rank_, f.len, spec.recvLen[p]);
                       if (f.other != spec.sendLen[p]) sizes(rank_, p, spec.sendLen[p], f.other);
                     }});
    recvs.push_back({p, spec.recvPtr[p], spec.recvLen[p]});
  }
  transfer(std::move(sends), std::move(recvs), coll_, dl);
  if (spec.sendLen[rank_] > 0 && spec.recvPtr[rank_] != spec.blob + spec.sendOff[rank_]) {
    std::memmove(spec.recvPtr[rank_], spec.blob + spec.sendOff[rank_], spec.sendLen[rank_]);
  }
}

void TcpBridge::send(int dst, const void* data, int64_t bytes, int tag, const Deadline& dl) {
  TORCH_CHECK(dst != rank_, "kaitian send: sending to yourself is not supported over TCP");
  TORCH_CHECK(p2p_[dst] >= 0, "kaitian send: the TCP bridge is closed");
  if (dl.fail && dl.fail->broken()) dl.fail->raise(dl.what);
  std::lock_guard<std::mutex> lock(sendMu_);
  if (p2pClean_.empty()) p2pClean_.assign(size_, 1);
  if (p2pSent_.empty()) p2pSent_.assign(size_, 0);
  Frame f{kFrameMagic, kP2P, 0, ++p2pSent_[dst], bytes, tag, dl.id};
  p2pClean_[dst] = 0;  // until the whole message is out
  ioAll(p2p_[dst], reinterpret_cast<uint8_t*>(&f), sizeof(f), true, dst, dl);
  ioAll(p2p_[dst], static_cast<uint8_t*>(const_cast<void*>(data)), bytes, true, dst, dl);
  p2pClean_[dst] = 1;
}

int TcpBridge::recv(int src, void* data, int64_t bytes, int tag, const Deadline& dl) {
  TORCH_CHECK(src != rank_, "kaitian recv: receiving from yourself is not supported over TCP");
  if (dl.fail && dl.fail->broken()) dl.fail->raise(dl.what);
  while (src < 0) {
    // Any source: sleep in poll() on every peer's connection (a dead peer's
    // closes, which wakes us too).
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
  if (p2pRecvd_.empty()) p2pRecvd_.assign(size_, 0);  // the receive thread only
  Frame f{};
  ioAll(p2p_[src], reinterpret_cast<uint8_t*>(&f), sizeof(f), false, src, dl);
  checkFrame(f, src, p2p_[src], kP2P, 0, 0, dl);
  const std::string from = "rank " + std::to_string(src);
  if (f.call != p2pRecvd_[src] + 1) {
    dl.breakGroup(from + " sent message " + std::to_string(f.call) + " where message " +
                  std::to_string(p2pRecvd_[src] + 1) + " was due (protocol error)");
  }
  if (f.other != tag) {
    dl.breakGroup("the next message from " + from + " has tag " + std::to_string(f.other) +
                  " but recv expects tag " + std::to_string(tag) +
                  "; kaitian delivers messages between two ranks in order");
  }
  if (f.len != bytes) {
    dl.breakGroup(from + " sent " + std::to_string(f.len) + " bytes but the receive tensor holds " +
                  std::to_string(bytes) + " bytes; use the same shape and dtype on both sides");
  }
  ioAll(p2p_[src], static_cast<uint8_t*>(data), bytes, false, src, dl);
  ++p2pRecvd_[src];
  return src;
}

void TcpBridge::poison(const std::string& firstFailure) {
  {
    std::lock_guard<std::mutex> lock(poisonMu_);
    if (poisonText_.empty()) poisonText_ = firstFailure.substr(0, kMaxFailureText);
  }
  abortChannel(coll_, collMu_, collClean_, collAborted_);
  abortChannel(p2p_, sendMu_, p2pClean_, p2pAborted_);
}

std::string TcpBridge::watchPeers(const std::vector<int>& with, const Deadline& dl,
                                  const std::string& what) {
  // Only the collectives thread reads the collective connections, and it is
  // here: peek, so that a peer already ahead in the next bridge call keeps
  // its data for that call. An abort frame is read (the group is broken).
  for (int p = 0; p < size_; ++p) {
    const int fd = p < static_cast<int>(coll_.size()) ? coll_[p] : -1;
    if (fd < 0) continue;
    raiseIfAborted(p, fd, dl);
    Frame f;
    const ssize_t k = ::recv(fd, &f, sizeof(f), MSG_PEEK | MSG_DONTWAIT);
    const bool watched = std::find(with.begin(), with.end(), p) != with.end();
    if (watched && (k == 0 || (k < 0 && peerGone()))) {
      return "rank " + std::to_string(p) + " failed or exited while this rank waited for " + what +
             " (its connection closed; see its log)";
    }
  }
  return "";
}

std::string TcpBridge::whyGone(int peer, const Deadline& /*dl*/, const std::string& what) {
  // Peeked, never read: the receive thread owns the stream (a peer that broke
  // the group and lives on is seen by the next receive, as its abort frame).
  const int fd = p2p_[peer];
  Frame f;
  const ssize_t k = fd < 0 ? 1 : ::recv(fd, &f, sizeof(f), MSG_PEEK | MSG_DONTWAIT);
  if (k == 0 || (k < 0 && peerGone())) return peerGoneText(peer, what) + " (its connection closed)";
  return "";
}

// An abort frame at the head of fd's incoming stream (peeked, never blocking):
// the peer's group broke; reads its first failure and raises it.
void TcpBridge::raiseIfAborted(int peer, int fd, const Deadline& dl) {
  Frame f;
  const ssize_t k = ::recv(fd, &f, sizeof(f), MSG_PEEK | MSG_DONTWAIT);
  if (k == static_cast<ssize_t>(sizeof(f)) && f.magic == kFrameMagic && f.kind == kAbort) {
    ioAll(fd, reinterpret_cast<uint8_t*>(&f), sizeof(f), false, peer, dl);
    checkFrame(f, peer, fd, kData, 0, 0, dl);  // reads the failure text and raises it
  }
}

// Sends an abort frame (with the first failure) on every connection of one
// channel whose outgoing stream stands at a frame boundary, then shuts the
// sending side: peers reading from us get the text, or at least EOF. Skipped
// while the channel's thread is inside a transfer; that thread finds the group
// broken within 100 ms and calls poison() again from its error path.
void TcpBridge::abortChannel(const std::vector<int>& fds, std::mutex& mu,
                             std::vector<char>& clean, bool& aborted) {
  std::unique_lock<std::mutex> lock(mu, std::try_to_lock);
  if (!lock.owns_lock() || aborted) return;
  aborted = true;
  std::string text;
  {
    std::lock_guard<std::mutex> plock(poisonMu_);
    text = poisonText_;
  }
  Frame f{kFrameMagic, kAbort, 0, 0, static_cast<int64_t>(text.size()), 0, OpId{}};
  std::string msg(reinterpret_cast<const char*>(&f), sizeof(f));
  msg += text;
  for (int p = 0; p < size_; ++p) {
    const int fd = fds[p];
    if (fd < 0) continue;
    if (clean.empty() || clean[p]) {
      // Best effort and never blocking: a peer that does not read gets EOF later.
      size_t off = 0;
      while (off < msg.size()) {
        const ssize_t k =
            ::send(fd, msg.data() + off, msg.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k <= 0) break;
        off += static_cast<size_t>(k);
      }
    }
    ::shutdown(fd, SHUT_WR);
  }
}

}  // namespace kaitian
