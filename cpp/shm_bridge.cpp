// Same-host shared-memory bridge. See shm_bridge.hpp for the layout idea.
//
// Collectives advance in "rounds" numbered identically on every rank. Round t
// uses slot t % 2 of each segment; a rank may reuse a slot only when every peer
// has finished round t - 2 (its `gathered` counter). Counters only grow, so they
// never need resetting between ops. Waiting is a short spin, then a futex on the
// peer's event word (shared-memory futexes work across processes), with the
// deadline and the peer's liveness checked between sleeps.
#include "shm_bridge.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <sched.h>

#include <cerrno>
#include <cstdlib>
#include <climits>
#include <cstring>
#include <fstream>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KAITIAN_CPU_RELAX() _mm_pause()
#else
#define KAITIAN_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace kaitian {

namespace {
constexpr uint64_t kMagic = 0x314e414954494b41ULL;  // "AKITIAN1"
constexpr int64_t kMsgHeader = 64;
// Chunk slots per segment: round t uses slot t % kSlots, so a fast rank can run
// up to kSlots - 1 rounds ahead of the slowest reader.
constexpr int64_t kSlots = 4;

struct alignas(64) Counter {
  std::atomic<uint64_t> v;
};
struct alignas(64) EventWord {
  std::atomic<uint32_t> seq;
  std::atomic<uint32_t> waiters;
};
struct MsgHeader {
  int64_t tag, total, offset, len;
};

int64_t alignUp(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

std::string sysError(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

void futexWait(std::atomic<uint32_t>* addr, uint32_t expected, long nanos) {
  struct timespec ts{nanos / 1000000000L, nanos % 1000000000L};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futexWakeAll(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

bool pidAlive(int64_t pid) {
  if (pid <= 0) return true;  // unknown (other pid namespace): rely on the deadline
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  std::string line;
  std::getline(stat, line);
  auto close = line.rfind(')');
  if (close != std::string::npos && close + 2 < line.size()) {
    const char state = line[close + 2];
    if (state == 'Z' || state == 'X') return false;
  }
  return true;
}
}  // namespace

struct ShmSegmentHeader {
  uint64_t magic;
  int64_t rank, world, chunk, mailbox, pid;
  alignas(64) EventWord ev;
  Counter pub, reduced, gathered;
  // followed by Counter p2pSent[world] and Counter p2pAck[world]
};

ShmBridge::ShmBridge(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                     const std::string& name, int64_t chunkBytes, std::vector<int64_t> pids,
                     std::chrono::milliseconds timeout, int64_t spinMicros)
    : rank_(rank), size_(size), pids_(std::move(pids)), peers_(size), spinMicros_(spinMicros) {
  chunk_ = std::max<int64_t>(alignUp(chunkBytes, 64), 4096);
  chunk_ = std::max<int64_t>(chunk_, alignUp((1 + 3 * static_cast<int64_t>(size)) * 8, 64));
  mailbox_ = std::min<int64_t>(chunk_, 1 << 20);
  const int64_t headerBytes =
      sizeof(ShmSegmentHeader) + 2 * static_cast<int64_t>(size) * sizeof(Counter);
  dataOff_ = alignUp(headerBytes, 4096);
  segBytes_ = dataOff_ + kSlots * 2 * chunk_ + static_cast<int64_t>(size) * (kMsgHeader + mailbox_);
  myName_ = name;
  TORCH_CHECK(!myName_.empty() && myName_[0] == '/' && myName_.find('/', 1) == std::string::npos,
              "kaitian: bad shared memory name ", myName_);

  auto cleanup = [&]() { close(); };
  try {
    const int fd = ::shm_open(myName_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    TORCH_CHECK(fd >= 0, sysError("kaitian: cannot create shared memory " + myName_ +
                                  " (is /dev/shm mounted and writable?)"));
    ::fchmod(fd, 0600);
    if (::ftruncate(fd, static_cast<off_t>(segBytes_)) != 0) {
      const std::string msg = sysError("kaitian: cannot size shared memory " + myName_ + " to " +
                                       std::to_string(segBytes_) + " bytes (is /dev/shm full? "
                                       "docker: raise --shm-size)");
      ::close(fd);
      TORCH_CHECK(false, msg);
    }
    void* p = ::mmap(nullptr, segBytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    ::close(fd);
    TORCH_CHECK(p != MAP_FAILED, sysError("kaitian: cannot map shared memory " + myName_));
    // MAP_POPULATE above and on the peers' mappings: page faults happen here,
    // not inside the first collective.
    peers_[rank].base = static_cast<uint8_t*>(p);
    auto* hdr = reinterpret_cast<ShmSegmentHeader*>(p);
    hdr->rank = rank;
    hdr->world = size;
    hdr->chunk = chunk_;
    hdr->mailbox = mailbox_;
    hdr->pid = ::getpid();
    std::atomic_thread_fence(std::memory_order_release);
    hdr->magic = kMagic;
    peers_[rank].hdr = hdr;

    store->set("kaitian/shm/" + std::to_string(rank),
               std::vector<uint8_t>(myName_.begin(), myName_.end()));
    for (int s = 0; s < size; ++s) {
      if (s == rank) continue;
      const std::string key = "kaitian/shm/" + std::to_string(s);
      store->wait({key}, timeout);
      auto raw = store->get(key);
      const std::string name(raw.begin(), raw.end());
      const int pfd = ::shm_open(name.c_str(), O_RDWR, 0600);
      TORCH_CHECK(pfd >= 0, sysError("kaitian: cannot open rank " + std::to_string(s) +
                                     "'s shared memory " + name));
      struct stat st{};
      ::fstat(pfd, &st);
      if (static_cast<size_t>(st.st_size) != segBytes_) {
        ::close(pfd);
        TORCH_CHECK(false, "kaitian: rank ", s, "'s shared memory has ", st.st_size,
                    " bytes, expected ", segBytes_,
                    "; all ranks must use the same KAITIAN_CHUNK_BYTES and world size");
      }
      void* q = ::mmap(nullptr, segBytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, pfd, 0);
      ::close(pfd);
      TORCH_CHECK(q != MAP_FAILED, sysError("kaitian: cannot map " + name));
      peers_[s].base = static_cast<uint8_t*>(q);
      peers_[s].hdr = reinterpret_cast<ShmSegmentHeader*>(q);
      TORCH_CHECK(peers_[s].hdr->magic == kMagic, "kaitian: ", name,
                  " is not a kaitian segment of this job");
    }
    // Everyone has mapped everything: drop the names so that a crash from here on
    // leaves nothing in /dev/shm.
    store->set("kaitian/mapped/" + std::to_string(rank), std::vector<uint8_t>{1});
    std::vector<std::string> keys;
    for (int s = 0; s < size; ++s) keys.push_back("kaitian/mapped/" + std::to_string(s));
    store->wait(keys, timeout);
    ::shm_unlink(myName_.c_str());
    unlinked_ = true;
  } catch (...) {
    cleanup();
    throw;
  }
}

ShmBridge::~ShmBridge() { close(); }

void ShmBridge::close() {
  for (auto& p : peers_) {
    if (p.base) ::munmap(p.base, segBytes_);
    p.base = nullptr;
    p.hdr = nullptr;
  }
  if (!unlinked_ && !myName_.empty()) {
    ::shm_unlink(myName_.c_str());
    unlinked_ = true;
  }
}

std::vector<std::pair<uintptr_t, int64_t>> ShmBridge::regions() const {
  std::vector<std::pair<uintptr_t, int64_t>> out;
  for (const auto& p : peers_) {
    if (p.base) out.emplace_back(reinterpret_cast<uintptr_t>(p.base), segBytes_);
  }
  return out;
}

uint8_t* ShmBridge::inArea(int r, uint64_t round) const {
  return peers_[r].base + dataOff_ + (round % kSlots) * 2 * chunk_;
}
uint8_t* ShmBridge::outArea(int r, uint64_t round) const {
  return inArea(r, round) + chunk_;
}
uint8_t* ShmBridge::mailbox(int owner, int dst) const {
  return peers_[owner].base + dataOff_ + kSlots * 2 * chunk_ + dst * (kMsgHeader + mailbox_);
}
std::atomic<uint64_t>& ShmBridge::p2pSent(int owner, int dst) const {
  auto* c = reinterpret_cast<Counter*>(peers_[owner].hdr + 1);
  return c[dst].v;
}
std::atomic<uint64_t>& ShmBridge::p2pAck(int owner, int src) const {
  auto* c = reinterpret_cast<Counter*>(peers_[owner].hdr + 1);
  return c[size_ + src].v;
}

void ShmBridge::signal() {
  auto& ev = peers_[rank_].hdr->ev;
  ev.seq.fetch_add(1, std::memory_order_seq_cst);
  if (ev.waiters.load(std::memory_order_seq_cst) > 0) futexWakeAll(&ev.seq);
}

void ShmBridge::checkPeerAlive(int peer, const Deadline& dl, const char* what) {
  const int64_t pid = peer < static_cast<int>(pids_.size()) ? pids_[peer] : -1;
  if (!pidAlive(pid)) {
    C10_THROW_ERROR(DistBackendError,
                    "kaitian " + dl.what + ": rank " + std::to_string(peer) + " (pid " +
                        std::to_string(pid) + ") exited while this rank waited for its " + what +
                        "; the job cannot continue (restart it; kaitianrun --max-restarts does "
                        "so automatically)");
  }
}

void ShmBridge::waitAtLeast(int peer, const std::atomic<uint64_t>& ctr, uint64_t target,
                            const Deadline& dl, const char* what) {
  if (ctr.load(std::memory_order_acquire) >= target) return;
  TORCH_CHECK(peers_[peer].hdr != nullptr, "kaitian ", dl.what, ": the bridge is closed");
  // Short spin: a peer in the same collective usually arrives within microseconds.
  const auto spinUntil = Clock::now() + std::chrono::microseconds(spinMicros_);
  for (int i = 0;; ++i) {
    if (ctr.load(std::memory_order_acquire) >= target) return;
    KAITIAN_CPU_RELAX();
    if ((i & 127) == 127) {
      if (Clock::now() >= spinUntil) break;
      if ((i & 4095) == 4095) sched_yield();  // let a descheduled peer run
    }
  }
  auto& ev = peers_[peer].hdr->ev;
  auto lastAliveCheck = Clock::now();
  while (true) {
    const uint32_t seen = ev.seq.load(std::memory_order_seq_cst);
    if (ctr.load(std::memory_order_seq_cst) >= target) return;
    ev.waiters.fetch_add(1, std::memory_order_seq_cst);
    if (ctr.load(std::memory_order_seq_cst) >= target) {
      ev.waiters.fetch_sub(1, std::memory_order_seq_cst);
      return;
    }
    futexWait(&ev.seq, seen, 2000000L);
    ev.waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (ctr.load(std::memory_order_acquire) >= target) return;
    const auto now = Clock::now();
    if (now - lastAliveCheck > std::chrono::milliseconds(50)) {
      checkPeerAlive(peer, dl, what);
      lastAliveCheck = now;
    }
    dl.check("rank " + std::to_string(peer) + "'s " + what);
  }
}

uint64_t ShmBridge::beginRound(const Deadline& dl) {
  const uint64_t t = round_;
  if (t >= static_cast<uint64_t>(kSlots)) {
    for (int s = 0; s < size_; ++s) {
      if (s != rank_) {
        waitAtLeast(s, peers_[s].hdr->gathered.v, t - kSlots + 1, dl, "previous round");
      }
    }
  }
  return t;
}

void ShmBridge::endRound(uint64_t t) {
  auto* h = peers_[rank_].hdr;
  h->reduced.v.store(t + 1, std::memory_order_release);
  h->gathered.v.store(t + 1, std::memory_order_release);
  signal();
  round_ = t + 1;
}

namespace detail {
std::pair<int, Range> ownerOf(const ReduceSpec& spec, int g, int64_t n, int64_t e) {
  const auto& ranks = spec.groups[g];
  const int64_t m = static_cast<int64_t>(ranks.size());
  const int64_t base = n / m, extra = n % m;
  int64_t i;
  if (e < extra * (base + 1)) {
    i = e / (base + 1);
  } else {
    i = extra + (e - extra * (base + 1)) / base;
  }
  return {ranks[i], evenPart(n, m, i)};
}
}  // namespace detail

void ShmBridge::reduce(ReduceSpec& spec, const Deadline& dl) {
  TORCH_CHECK(peers_[rank_].hdr != nullptr, "kaitian ", dl.what, ": the bridge is closed");
  const int64_t n = spec.buf.numel();
  const int64_t es = static_cast<int64_t>(spec.buf.element_size());
  const int64_t ce = std::max<int64_t>(1, chunk_ / es);
  auto* base = static_cast<uint8_t*>(spec.buf.data_ptr());
  const int myG = spec.groupOf[rank_];
  const auto& myRanks = spec.groups[myG];
  const int64_t myIdx = std::find(myRanks.begin(), myRanks.end(), rank_) - myRanks.begin();
  const Range pubRange = evenPart(n, static_cast<int64_t>(myRanks.size()), myIdx);
  const Range mine = spec.stripes[rank_];
  auto* hdr = peers_[rank_].hdr;
  std::vector<const void*> srcs;
  auto gatherChunk = [&](const Range& chunk, uint64_t t) {
    if (!spec.gather) return;
    for (int s = 0; s < size_; ++s) {
      if (s == rank_) continue;
      const Range r = spec.stripes[s].intersect(chunk);
      if (r.size() == 0) continue;
      waitAtLeast(s, peers_[s].hdr->reduced.v, t + 1, dl, "reduced stripe");
      std::memcpy(base + r.begin * es, outArea(s, t) + (r.begin - chunk.begin) * es, r.size() * es);
    }
  };
  bool havePrev = false;
  Range prevChunk;
  uint64_t prevRound = 0;
  for (int64_t c0 = 0; c0 < n; c0 += ce) {
    const Range chunk{c0, std::min(n, c0 + ce)};
    const uint64_t t = beginRound(dl);
    uint8_t* in = inArea(rank_, t);
    // 1. Publish the part of our group's partial that other groups' reducers need.
    const Range pub = pubRange.intersect(chunk);
    for (const Range& piece : {Range{pub.begin, std::min(pub.end, mine.begin)},
                               Range{std::max(pub.begin, mine.end), pub.end}}) {
      if (piece.size() > 0) {
        std::memcpy(in + (piece.begin - c0) * es, base + piece.begin * es, piece.size() * es);
      }
    }
    hdr->pub.v.store(t + 1, std::memory_order_release);
    signal();
    // 2. Reduce our stripe: own partial from buf, other groups' from their owners.
    const Range red = mine.intersect(chunk);
    int64_t x = red.begin;
    while (x < red.end) {
      int64_t y = red.end;
      srcs.assign(1, base + x * es);
      for (int g = 0; g < static_cast<int>(spec.groups.size()); ++g) {
        if (g == myG) continue;
        auto [owner, stripe] = detail::ownerOf(spec, g, n, x);
        y = std::min(y, stripe.end);
        waitAtLeast(owner, peers_[owner].hdr->pub.v, t + 1, dl, "published data");
        srcs.push_back(inArea(owner, t) + (x - c0) * es);
      }
      spec.reducer(srcs, y - x, base + x * es,
                   spec.gather ? outArea(rank_, t) + (x - c0) * es : nullptr);
      x = y;
    }
    hdr->reduced.v.store(t + 1, std::memory_order_release);
    signal();
    // 3. Collect the previous chunk's results: one round of slack for the peers.
    if (havePrev) {
      gatherChunk(prevChunk, prevRound);
      hdr->gathered.v.store(t, std::memory_order_release);  // rounds < t are done
      signal();
    }
    havePrev = true;
    prevChunk = chunk;
    prevRound = t;
    round_ = t + 1;
  }
  if (havePrev) {
    gatherChunk(prevChunk, prevRound);
    endRound(prevRound);
  }
}

void ShmBridge::exchange(const ExchangeSpec& spec, const Deadline& dl) {
  TORCH_CHECK(peers_[rank_].hdr != nullptr, "kaitian ", dl.what, ": the bridge is closed");
  const int W = size_;
  auto* hdr = peers_[rank_].hdr;
  // Meta round: every rank publishes its blob length and per-peer offsets/lengths.
  uint64_t t = beginRound(dl);
  auto* meta = reinterpret_cast<int64_t*>(inArea(rank_, t));
  meta[0] = spec.blobLen;
  for (int d = 0; d < W; ++d) {
    meta[1 + d] = spec.sendOff[d];
    meta[1 + W + d] = spec.sendLen[d];
    meta[1 + 2 * W + d] = spec.recvLen[d];
  }
  hdr->pub.v.store(t + 1, std::memory_order_release);
  signal();
  int64_t maxLen = spec.blobLen;
  std::vector<int64_t> offFrom(W), lenFrom(W);
  std::string mismatch;
  std::vector<const int64_t*> metas(W);
  for (int s = 0; s < W; ++s) {
    if (s != rank_) waitAtLeast(s, peers_[s].hdr->pub.v, t + 1, dl, "arrival");
    metas[s] = reinterpret_cast<const int64_t*>(inArea(s, t));
  }
  for (int s = 0; s < W; ++s) {
    maxLen = std::max(maxLen, metas[s][0]);
    offFrom[s] = metas[s][1 + rank_];
    lenFrom[s] = metas[s][1 + W + rank_];
    for (int d = 0; d < W && mismatch.empty(); ++d) {
      const int64_t sent = metas[s][1 + W + d], expected = metas[d][1 + 2 * W + s];
      if (sent != expected) {
        mismatch = "rank " + std::to_string(s) + " sends " + std::to_string(sent) +
                   " bytes to rank " + std::to_string(d) + ", which expects " +
                   std::to_string(expected) + " bytes";
      }
    }
  }
  endRound(t);
  TORCH_CHECK(mismatch.empty(), "kaitian ", dl.what, ": tensor sizes differ between ranks: ",
              mismatch, "; every rank must pass matching shapes/split sizes");
  const int64_t rounds = (maxLen + chunk_ - 1) / chunk_;
  for (int64_t k = 0; k < rounds; ++k) {
    t = beginRound(dl);
    const Range win = Range{k * chunk_, (k + 1) * chunk_}.intersect(Range{0, spec.blobLen});
    if (win.size() > 0) std::memcpy(inArea(rank_, t), spec.blob + win.begin, win.size());
    hdr->pub.v.store(t + 1, std::memory_order_release);
    signal();
    for (int s = 0; s < W; ++s) {
      if (s == rank_ || lenFrom[s] == 0) continue;
      const Range need = Range{offFrom[s], offFrom[s] + lenFrom[s]}.intersect(
          Range{k * chunk_, (k + 1) * chunk_});
      if (need.size() == 0) continue;
      waitAtLeast(s, peers_[s].hdr->pub.v, t + 1, dl, "data");
      std::memcpy(spec.recvPtr[s] + (need.begin - offFrom[s]),
                  inArea(s, t) + (need.begin - k * chunk_), need.size());
    }
    endRound(t);
  }
  if (spec.sendLen[rank_] > 0 && spec.recvPtr[rank_] != spec.blob + spec.sendOff[rank_]) {
    std::memmove(spec.recvPtr[rank_], spec.blob + spec.sendOff[rank_], spec.sendLen[rank_]);
  }
}

void ShmBridge::send(int dst, const void* data, int64_t bytes, int tag, const Deadline& dl) {
  TORCH_CHECK(peers_[rank_].hdr != nullptr, "kaitian send: the bridge is closed");
  auto* src = static_cast<const uint8_t*>(data);
  int64_t off = 0;
  do {
    auto& sent = p2pSent(rank_, dst);
    const uint64_t seq = sent.load(std::memory_order_relaxed);
    waitAtLeast(dst, p2pAck(dst, rank_), seq, dl, "receive");
    const int64_t len = std::min(mailbox_, bytes - off);
    auto* box = mailbox(rank_, dst);
    auto* h = reinterpret_cast<MsgHeader*>(box);
    h->tag = tag;
    h->total = bytes;
    h->offset = off;
    h->len = len;
    if (len > 0) std::memcpy(box + kMsgHeader, src + off, len);
    sent.store(seq + 1, std::memory_order_release);
    signal();
    off += len;
  } while (off < bytes);
}

int ShmBridge::recv(int src, void* data, int64_t bytes, int tag, const Deadline& dl) {
  TORCH_CHECK(peers_[rank_].hdr != nullptr, "kaitian recv: the bridge is closed");
  if (src < 0) {
    // Any source: poll the mailboxes (no single futex to sleep on).
    auto lastAlive = Clock::now();
    for (int spin = 0; src < 0; ++spin) {
      for (int s = 0; s < size_ && src < 0; ++s) {
        if (s == rank_) continue;
        if (p2pSent(s, rank_).load(std::memory_order_acquire) >
            p2pAck(rank_, s).load(std::memory_order_relaxed)) {
          src = s;
        }
      }
      if (src >= 0) break;
      if (spin > 1000) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        dl.check("a message from any rank");
      }
      if (Clock::now() - lastAlive > std::chrono::milliseconds(200)) lastAlive = Clock::now();
    }
  }
  auto* out = static_cast<uint8_t*>(data);
  int64_t off = 0;
  do {
    auto& ack = p2pAck(rank_, src);
    const uint64_t seq = ack.load(std::memory_order_relaxed);
    waitAtLeast(src, p2pSent(src, rank_), seq + 1, dl, "send");
    auto* box = mailbox(src, rank_);
    const auto* h = reinterpret_cast<const MsgHeader*>(box);
    TORCH_CHECK(h->tag == tag, "kaitian recv: the next message from rank ", src, " has tag ",
                h->tag, " but recv expects tag ", tag,
                "; kaitian delivers messages between two ranks in order, so post receives in "
                "the order the sends were issued");
    TORCH_CHECK(h->total == bytes, "kaitian recv: rank ", src, " sent ", h->total,
                " bytes but the receive tensor holds ", bytes,
                " bytes; use the same shape and dtype on both sides");
    if (h->len > 0) std::memcpy(out + h->offset, box + kMsgHeader, h->len);
    off = h->offset + h->len;
    ack.store(seq + 1, std::memory_order_release);
    signal();
  } while (off < bytes);
  return src;
}

}  // namespace kaitian
