#include "tcp_mesh.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common.hpp"
#include "sha256.hpp"

namespace kaitian {

namespace {

constexpr char kMagic[8] = {'K', 'T', 'B', 'R', 'I', 'D', 'G', 'E'};
constexpr size_t kNonceBytes = 32;
constexpr size_t kChallengeBytes = 8 + 3 * 4 + kNonceBytes;   // magic, version, size, rank, nonce
constexpr size_t kHelloBytes = 8 + 4 * 4 + kNonceBytes + 32;  // ... channel, nonce, proof
constexpr size_t kWelcomeBytes = 32;                          // the server's proof
constexpr int kMaxLoggedDrops = 20;
constexpr int kMaxUnproven = 16;  // plus two per rank: connections waiting for a hello
constexpr auto kFirstRetry = std::chrono::milliseconds(50);
constexpr auto kLastRetry = std::chrono::milliseconds(2000);

// A connection that must be given up, and why (for the log or the final error).
struct Refused {
  std::string why;
};

std::string errnoText(int err = errno) { return std::strerror(err); }

void putU32(std::string& s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>(v >> (8 * i)));
}

uint32_t getU32(const std::string& s, size_t at) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data()) + at;
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

std::string randomBytes(size_t n) {
  std::string out(n, '\0');
  for (size_t got = 0; got < n;) {
    const ssize_t k = ::getrandom(&out[got], n - got, 0);
    if (k < 0 && errno == EINTR) continue;
    TORCH_CHECK(k > 0, "kaitian: no randomness for the TCP bridge handshake: ", errnoText());
    got += static_cast<size_t>(k);
  }
  return out;
}

std::string addrText(const sockaddr_in& a) {
  char buf[INET_ADDRSTRLEN] = "?";
  ::inet_ntop(AF_INET, &a.sin_addr, buf, sizeof(buf));
  return std::string(buf) + ":" + std::to_string(ntohs(a.sin_port));
}

std::string seconds(std::chrono::milliseconds t) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", t.count() / 1000.0);
  return buf;
}

void tune(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  int buf = 4 << 20;
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
}

// Binds `host` on the first free port of the range (any port without one) and listens. With
// SO_REUSEADDR two ranks of a host may both bind a port nobody listens on yet: the first to listen
// keeps it, and the other goes on to the next port as if its bind had failed.
int listenOn(const MeshOptions& o, int backlog, std::string* advertised) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  TORCH_CHECK(::inet_pton(AF_INET, o.host.c_str(), &addr.sin_addr) == 1,
              "kaitian: TCP bridge address ", o.host, " is not an IPv4 address");
  const bool ranged = o.portLo > 0;
  for (int port = ranged ? o.portLo : 0; port <= (ranged ? o.portHi : 0); ++port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    TORCH_CHECK(fd >= 0, "kaitian: cannot create a TCP socket: ", errnoText());
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    addr.sin_port = htons(static_cast<uint16_t>(port));
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 && ::listen(fd, backlog) == 0) {
      socklen_t len = sizeof(addr);
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
      *advertised = addrText(addr);
      return fd;
    }
    const int err = errno;
    ::close(fd);
    TORCH_CHECK(ranged && err == EADDRINUSE, "kaitian: cannot listen on ", o.host, ":", port, ": ",
                errnoText(err));
  }
  TORCH_CHECK(false, "kaitian: no free port in KAITIAN_BRIDGE_PORTS=", o.portLo, "-", o.portHi,
              " on ", o.host, " (all ", o.portHi - o.portLo + 1, " in use); widen the range");
}

// One handshake in progress. Servers: SendChallenge, ReadHello, SendWelcome.
// Clients: Connect, ReadChallenge, SendHello, ReadWelcome. Then Done.
struct Conn {
  enum class Step { Connect, SendChallenge, ReadHello, SendWelcome, ReadChallenge, SendHello, ReadWelcome, Done };
  int fd = -1;
  int dial = -1;  // index into the dials (clients), -1 for accepted connections
  Step step = Step::Connect;
  int peer = -1, channel = -1;  // known to clients at once, to servers after the hello
  std::string addr;             // the other end, for messages
  std::string nonceS, nonceC;
  std::string out;  // the message being sent
  size_t sent = 0;
  std::string in;  // the message being read
  size_t want = 0;
};

// A connection this rank must open: to rank `peer` on `channel`, retried until it works.
struct Dial {
  int peer, channel;
  sockaddr_in addr;
  std::string addrText;
  bool active = false, done = false;
  Clock::time_point retryAt{};
  std::chrono::milliseconds backoff = kFirstRetry;
  std::string lastError;
};

class MeshBuilder {
 public:
  MeshBuilder(int rank, int size, const MeshOptions& o)
      : rank_(rank), size_(size), o_(o), claimed_(2, std::vector<bool>(size, false)) {
    mesh_.coll.assign(size, -1);
    mesh_.p2p.assign(size, -1);
  }
  ~MeshBuilder() {
    for (auto& c : conns_) closeFd(c.fd);
    closeFd(listen_);
    for (auto* v : {&mesh_.coll, &mesh_.p2p}) for (int& fd : *v) closeFd(fd);
  }

  Mesh build(c10d::Store& store, std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    std::string me;
    listen_ = listenOn(o_, 2 * size_ + 8, &me);
    store.set(key(rank_), std::vector<uint8_t>(me.begin(), me.end()));
    for (int s = 0; s < rank_; ++s) lookUp(store, s, deadline, timeout);
    const int needed = 2 * (size_ - 1);
    while (established_ < needed) {
      const auto now = Clock::now();
      if (now >= deadline) timedOut(timeout);
      startDials(now);
      poll(deadline);
      conns_.erase(std::remove_if(conns_.begin(), conns_.end(), [](const Conn& c) { return c.fd < 0; }),
                   conns_.end());
    }
    for (auto& c : conns_) {  // strangers still talking when the group became complete
      drop(c, c.in.empty() && c.step <= Conn::Step::ReadHello
                  ? "no hello before the group was complete"
                  : "its handshake was not finished when the group was complete");
    }
    Mesh out = std::move(mesh_);
    mesh_.coll.assign(size_, -1);
    mesh_.p2p.assign(size_, -1);
    return out;
  }

 private:
  static std::string key(int r) { return "kaitian/tcp/" + std::to_string(r); }
  static void closeFd(int& fd) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }

  void lookUp(c10d::Store& store, int s, Clock::time_point deadline, std::chrono::milliseconds timeout) {
    const auto left = std::max(std::chrono::milliseconds(1),
                               std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
    try {
      store.wait({key(s)}, left);
    } catch (const c10::Error&) {
      C10_THROW_ERROR(DistBackendError, "kaitian TCP bridge setup: timed out after " + seconds(timeout) +
                                            " s; waiting for rank " + std::to_string(s) +
                                            " to publish its bridge address (did it start?)");
    }
    const auto raw = store.get(key(s));
    const std::string text(raw.begin(), raw.end());
    const auto colon = text.rfind(':');
    sockaddr_in a{};
    a.sin_family = AF_INET;
    int port = 0;
    try {
      port = colon == std::string::npos ? 0 : std::stoi(text.substr(colon + 1));
    } catch (const std::exception&) {
    }
    TORCH_CHECK(port > 0 && port < 65536 && ::inet_pton(AF_INET, text.substr(0, colon).c_str(), &a.sin_addr) == 1,
                "kaitian TCP bridge setup: rank ", s, " published a malformed address '", text, "'");
    a.sin_port = htons(static_cast<uint16_t>(port));
    for (int ch = 0; ch < 2; ++ch) dials_.push_back(Dial{s, ch, a, text});
  }

  [[noreturn]] void timedOut(std::chrono::milliseconds timeout) {
    std::string what;
    for (const auto& d : dials_) {
      if (!d.done) {
        const bool unreachable = d.lastError.empty() || d.lastError.rfind("connect failed", 0) == 0;
        what = "connecting to rank " + std::to_string(d.peer) + " at " + d.addrText + ": " +
               (d.lastError.empty() ? "no answer" : d.lastError) +
               (unreachable ? " (a firewall? open KAITIAN_BRIDGE_PORTS between the hosts, or set "
                              "KAITIAN_BRIDGE_ADDR to an address the peers can reach)"
                            : "");
        break;
      }
    }
    if (what.empty()) {
      std::string missing;
      for (int r = rank_ + 1; r < size_; ++r) {
        if (mesh_.coll[r] < 0 || mesh_.p2p[r] < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      what = "waiting for rank" + std::string(missing.find(',') == std::string::npos ? " " : "s ") +
             missing + " to connect";
      if (dropped_ > 0) {
        what += " (dropped " + std::to_string(dropped_) + " connection" + (dropped_ == 1 ? "" : "s") +
                ", last: " + lastDrop_ + ")";
      }
    }
    C10_THROW_ERROR(DistBackendError,
                    "kaitian TCP bridge setup: timed out after " + seconds(timeout) + " s; " + what);
  }

  void startDials(Clock::time_point now) {
    for (size_t i = 0; i < dials_.size(); ++i) {
      Dial& d = dials_[i];
      if (d.done || d.active || now < d.retryAt) continue;
      Conn c;
      c.fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      TORCH_CHECK(c.fd >= 0, "kaitian: cannot create a TCP socket: ", errnoText());
      tune(c.fd);
      c.dial = static_cast<int>(i);
      c.peer = d.peer;
      c.channel = d.channel;
      c.addr = d.addrText;
      d.active = true;
      if (::connect(c.fd, reinterpret_cast<const sockaddr*>(&d.addr), sizeof(d.addr)) == 0) {
        expect(c, Conn::Step::ReadChallenge, kChallengeBytes);
      } else if (errno == EINPROGRESS) {
        c.step = Conn::Step::Connect;
      } else {
        failDial(c, "connect failed: " + errnoText());
        continue;
      }
      conns_.push_back(std::move(c));
    }
  }

  void poll(Clock::time_point deadline) {
    std::vector<pollfd> pfds{{listen_, POLLIN, 0}};
    for (const auto& c : conns_) {
      const bool sending = c.step == Conn::Step::Connect || c.step == Conn::Step::SendChallenge ||
                           c.step == Conn::Step::SendWelcome || c.step == Conn::Step::SendHello;
      pfds.push_back({c.fd, static_cast<short>(sending ? POLLOUT : POLLIN), 0});
    }
    auto wake = std::min(deadline, Clock::now() + std::chrono::milliseconds(100));
    for (const auto& d : dials_) {
      if (!d.done && !d.active) wake = std::min(wake, d.retryAt);
    }
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(wake - Clock::now()).count();
    if (::poll(pfds.data(), pfds.size(), static_cast<int>(std::max<int64_t>(0, ms))) <= 0) return;
    for (size_t i = 1; i < pfds.size(); ++i) {
      if (pfds[i].revents == 0) continue;
      Conn& c = conns_[i - 1];
      try {
        progress(c);
      } catch (const Refused& r) {
        if (c.dial >= 0) {
          failDial(c, r.why);
        } else {
          drop(c, r.why);
        }
      }
    }
    if (pfds[0].revents) accept();
  }

  void accept() {
    while (true) {
      sockaddr_in a{};
      socklen_t len = sizeof(a);
      const int fd = ::accept4(listen_, reinterpret_cast<sockaddr*>(&a), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;  // EAGAIN, or a connection that died in the backlog
      Conn c;
      c.fd = fd;
      c.addr = addrText(a);
      // Real ranks finish their handshake in milliseconds: when too many connections
      // wait without a proof, the oldest such one makes room (a flood cannot lock ranks out).
      const auto unproven = [](const Conn& x) {
        return x.fd >= 0 && x.dial < 0 && x.step <= Conn::Step::ReadHello;
      };
      if (std::count_if(conns_.begin(), conns_.end(), unproven) >= kMaxUnproven + 2 * size_) {
        drop(*std::find_if(conns_.begin(), conns_.end(), unproven),
             "too many connections were waiting for their handshake; dropped the oldest");
      }
      tune(fd);
      c.nonceS = randomBytes(kNonceBytes);
      c.out.assign(kMagic, sizeof(kMagic));
      putU32(c.out, kTcpProtocolVersion);
      putU32(c.out, static_cast<uint32_t>(size_));
      putU32(c.out, static_cast<uint32_t>(rank_));
      c.out += c.nonceS;
      c.step = Conn::Step::SendChallenge;
      conns_.push_back(std::move(c));
    }
  }

  static void expect(Conn& c, Conn::Step step, size_t bytes) {
    c.step = step;
    c.in.clear();
    c.want = bytes;
  }

  static void send(Conn& c, Conn::Step step, std::string message) {
    c.step = step;
    c.out = std::move(message);
    c.sent = 0;
  }

  // Moves the connection's I/O as far as the socket allows, and its handshake with it.
  void progress(Conn& c) {
    while (c.fd >= 0 && c.step != Conn::Step::Done) {
      if (c.step == Conn::Step::Connect) {
        int err = 0;
        socklen_t len = sizeof(err);
        ::getsockopt(c.fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err == EINPROGRESS || err == EALREADY) return;
        if (err != 0) throw Refused{"connect failed: " + errnoText(err)};
        expect(c, Conn::Step::ReadChallenge, kChallengeBytes);
      } else if (!c.out.empty()) {
        const ssize_t k = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
        if (k < 0) {
          if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
          throw Refused{"the connection failed: " + errnoText()};
        }
        c.sent += static_cast<size_t>(k);
        if (c.sent < c.out.size()) return;
        c.out.clear();
        sent(c);
      } else {
        char buf[kHelloBytes];
        const ssize_t k = ::recv(c.fd, buf, c.want - c.in.size(), 0);  // never past this message
        if (k == 0) throw Refused{closedText(c)};
        if (k < 0) {
          if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
          throw Refused{"the connection failed: " + errnoText()};
        }
        c.in.append(buf, static_cast<size_t>(k));
        const size_t head = std::min(c.in.size(), sizeof(kMagic));
        if (c.step != Conn::Step::ReadWelcome && std::memcmp(c.in.data(), kMagic, head) != 0) {
          throw Refused{c.dial < 0 ? "not a kaitian bridge hello"
                                   : "it is not a kaitian bridge (no challenge)"};
        }
        if (c.in.size() == c.want) received(c);
      }
    }
  }

  static std::string closedText(const Conn& c) {
    switch (c.step) {
      case Conn::Step::ReadHello: return "it closed the connection before its hello";
      case Conn::Step::ReadChallenge: return "it closed the connection before its challenge";
      default:
        return "it closed the connection after this rank's proof (does it hold another key? "
               "KAITIAN_JOB_KEY must be the same on every rank)";
    }
  }

  // The proof a client ("client") or server ("server") gives for this handshake.
  std::string proof(const char* role, const Conn& c, int server, int client) const {
    std::string m = std::string("kaitian bridge ") + role;
    m.push_back('\0');
    putU32(m, kTcpProtocolVersion);
    putU32(m, static_cast<uint32_t>(size_));
    putU32(m, static_cast<uint32_t>(server));
    putU32(m, static_cast<uint32_t>(client));
    putU32(m, static_cast<uint32_t>(c.channel));
    m += c.nonceS;
    m += c.nonceC;
    m += o_.session;
    const Digest d = hmacSha256(o_.key, m);
    return std::string(d.begin(), d.end());
  }

  // Checks the version and world size of a challenge or hello.
  void checkHeader(const Conn& c) const {
    const uint32_t version = getU32(c.in, 8), size = getU32(c.in, 12);
    if (version != kTcpProtocolVersion) {
      throw Refused{"it speaks bridge protocol " + std::to_string(version) + ", this rank speaks " +
                    std::to_string(kTcpProtocolVersion) + " (another kaitian version?)"};
    }
    if (size != static_cast<uint32_t>(size_)) {
      throw Refused{"it belongs to a group of " + std::to_string(size) + " ranks, not " +
                    std::to_string(size_)};
    }
  }

  void sent(Conn& c) {
    if (c.step == Conn::Step::SendChallenge) {
      expect(c, Conn::Step::ReadHello, kHelloBytes);
    } else if (c.step == Conn::Step::SendHello) {
      expect(c, Conn::Step::ReadWelcome, kWelcomeBytes);
    } else {  // SendWelcome
      established(c);
    }
  }

  void received(Conn& c) {
    if (c.step == Conn::Step::ReadHello) {
      checkHeader(c);
      const int peer = static_cast<int>(getU32(c.in, 16)), channel = static_cast<int>(getU32(c.in, 20));
      if (peer <= rank_ || peer >= size_ || (channel != 0 && channel != 1)) {
        throw Refused{"it claims rank " + std::to_string(peer) + " channel " + std::to_string(channel) +
                      ", which does not connect to rank " + std::to_string(rank_)};
      }
      c.peer = peer;
      c.channel = channel;
      c.nonceC = c.in.substr(24, kNonceBytes);
      const std::string expected = proof("client", c, rank_, peer);
      if (!sameDigest(reinterpret_cast<const uint8_t*>(c.in.data()) + 24 + kNonceBytes,
                      reinterpret_cast<const uint8_t*>(expected.data()))) {
        throw Refused{"its proof does not match this job's key (another job, or a different KAITIAN_JOB_KEY)"};
      }
      if (claimed_[channel][peer]) throw Refused{"that rank and channel are already connected"};
      claimed_[channel][peer] = true;
      send(c, Conn::Step::SendWelcome, proof("server", c, rank_, peer));
    } else if (c.step == Conn::Step::ReadChallenge) {
      checkHeader(c);
      const int server = static_cast<int>(getU32(c.in, 16));
      if (server != c.peer) {
        throw Refused{"it answers as rank " + std::to_string(server) + " (a stale address?)"};
      }
      c.nonceS = c.in.substr(20, kNonceBytes);
      c.nonceC = randomBytes(kNonceBytes);
      std::string hello(kMagic, sizeof(kMagic));
      putU32(hello, kTcpProtocolVersion);
      putU32(hello, static_cast<uint32_t>(size_));
      putU32(hello, static_cast<uint32_t>(rank_));
      putU32(hello, static_cast<uint32_t>(c.channel));
      hello += c.nonceC;
      hello += proof("client", c, c.peer, rank_);
      send(c, Conn::Step::SendHello, std::move(hello));
    } else {  // ReadWelcome
      const std::string expected = proof("server", c, c.peer, rank_);
      if (!sameDigest(reinterpret_cast<const uint8_t*>(c.in.data()),
                      reinterpret_cast<const uint8_t*>(expected.data()))) {
        throw Refused{"its answer does not prove it holds this job's key (KAITIAN_JOB_KEY must be "
                      "the same on every rank)"};
      }
      dials_[c.dial].done = true;
      established(c);
    }
  }

  void established(Conn& c) {
    (c.channel == 0 ? mesh_.coll : mesh_.p2p)[c.peer] = c.fd;
    c.fd = -1;  // owned by the mesh now
    c.step = Conn::Step::Done;
    ++established_;
  }

  void failDial(Conn& c, const std::string& why) {
    Dial& d = dials_[c.dial];
    d.lastError = why;
    d.active = false;
    d.retryAt = Clock::now() + d.backoff;
    d.backoff = std::min(2 * d.backoff, std::chrono::duration_cast<std::chrono::milliseconds>(kLastRetry));
    closeFd(c.fd);
  }

  void drop(Conn& c, const std::string& why) {
    if (c.step == Conn::Step::SendWelcome) claimed_[c.channel][c.peer] = false;  // it may retry
    ++dropped_;
    lastDrop_ = why;
    if (dropped_ <= kMaxLoggedDrops) {
      const std::string claims = c.peer >= 0 ? " (claims rank " + std::to_string(c.peer) + ", channel " +
                                                   std::to_string(c.channel) + ")"
                                             : "";
      std::fprintf(stderr, "[kaitian rank %d] TCP bridge: dropped a connection from %s%s: %s%s\n", rank_,
                   c.addr.c_str(), claims.c_str(), why.c_str(),
                   dropped_ == kMaxLoggedDrops ? " (further drops are not logged)" : "");
    }
    closeFd(c.fd);
  }

  const int rank_, size_;
  const MeshOptions& o_;
  int listen_ = -1;
  Mesh mesh_;
  std::vector<Conn> conns_;
  std::vector<Dial> dials_;
  std::vector<std::vector<bool>> claimed_;  // per channel and rank: a proven hello arrived
  int established_ = 0, dropped_ = 0;
  std::string lastDrop_;
};

}  // namespace

Mesh connectMesh(c10d::Store& store, int rank, int size, const MeshOptions& opts,
                 std::chrono::milliseconds timeout) {
  TORCH_CHECK(!opts.key.empty(), "kaitian: the TCP bridge needs a job key");
  return MeshBuilder(rank, size, opts).build(store, timeout);
}

}  // namespace kaitian
