// Same-host shared-memory bridge. See shm_bridge.hpp for the layout idea.
//
// Collectives advance in "rounds" numbered identically on every rank. Round t
// uses slot t % kSlots of each segment; a rank may reuse a slot only when every
// peer has finished round t - kSlots (its `gathered` counter). Counters only
// grow, so they never need resetting between ops. Before a rank publishes a
// round it writes the round's identity (bridge call number, round, OpId) into
// the slot's header; a reader checks it before using the slot's data, so ranks
// in different collectives raise instead of mixing data. Waiting is a short
// spin, then a futex on the peer's event word (shared-memory futexes work
// across processes), with the deadline, the peers' fail-stop state and the
// peer's liveness (pid, or heartbeat across pid namespaces) checked between
// sleeps. Point-to-point messages go through per-pair mailboxes; senders and
// receivers ring each other's `inbox` word.
#include "shm_bridge.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KAITIAN_CPU_RELAX() _mm_pause()
#else
#define KAITIAN_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace kaitian {

struct alignas(64) ShmEventWord {
  std::atomic<uint32_t> seq;
  std::atomic<uint32_t> waiters;
};

namespace {
constexpr uint64_t kMagic = 0x344e414954494b41ULL;  // "AKITIAN4"
// Chunk slots per segment: round t uses slot t % kSlots, so a fast rank can run
// up to kSlots - 1 rounds ahead of the slowest reader.
constexpr int64_t kSlots = 4;
constexpr int64_t kMinMailbox = 4096;
constexpr long kSleepNanos = 20 * 1000 * 1000;  // one futex sleep; checks in between
// Yields before sleeping when the ranks outnumber the cores (instead of a spin).
constexpr int kOversubscribedYields = 2;
constexpr auto kAliveEvery = std::chrono::milliseconds(50);
enum State : uint32_t { kRunning = 0, kBroken = 1, kClosed = 2 };

struct alignas(64) Counter {
  std::atomic<uint64_t> v;
};
// The identity of one collective round in one slot.
struct alignas(64) SlotHeader {
  uint64_t call, round;
  int32_t kind, pad;
  OpId id;
};
// One point-to-point piece in a mailbox.
struct alignas(64) MsgHeader {
  uint64_t seq;
  int64_t tag, total, offset, len;
};

int64_t alignUp(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

std::string sysError(const std::string& what) { return what + ": " + std::strerror(errno); }

void futexWait(std::atomic<uint32_t>* addr, uint32_t expected, long nanos) {
  struct timespec ts{nanos / 1000000000L, nanos % 1000000000L};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futexWakeAll(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void wake(ShmEventWord& ev, bool always) {
  ev.seq.fetch_add(1, std::memory_order_seq_cst);
  if (always || ev.waiters.load(std::memory_order_seq_cst) > 0) futexWakeAll(&ev.seq);
}

// Cores this process may run on (its affinity mask), at least one.
int usableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

bool pidAlive(int64_t pid) {
  if (pid <= 0) return true;  // unknown (other pid namespace): the heartbeat tells
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

std::string seconds(Clock::duration d) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f",
                std::chrono::duration_cast<std::chrono::milliseconds>(d).count() / 1000.0);
  return buf;
}
}  // namespace

struct ShmSegmentHeader {
  uint64_t magic;
  int64_t rank, world, chunk, mailbox, pid;
  ShmEventWord ev;     // collectives: bumped after every counter store
  ShmEventWord inbox;  // p2p: rung by peers that sent to or acked this rank
  Counter pub, reduced, gathered;
  Counter heartbeat;   // bumped every 100 ms while the bridge is open
  alignas(64) std::atomic<uint32_t> state;
  char failure[kMaxFailureText + 1];
  // The collective this rank is in, for peers waiting in a vendor's step,
  // which carries no call identity: a seqlock, odd while it is rewritten.
  alignas(64) std::atomic<uint64_t> opVersion;
  OpId op;
  SlotHeader slot[kSlots];
  // followed by MsgHeader box[world], Counter p2pSent[world], Counter p2pAck[world]
};

namespace {
int64_t headerBytes(int size) {
  return alignUp(sizeof(ShmSegmentHeader) + static_cast<int64_t>(size) *
                                                (sizeof(MsgHeader) + 2 * sizeof(Counter)),
                 4096);
}
int64_t chunkFor(int size, int64_t chunkBytes) {
  int64_t c = std::max<int64_t>(alignUp(chunkBytes, 64), 4096);
  return std::max<int64_t>(c, alignUp((1 + 3 * static_cast<int64_t>(size)) * 8, 64));
}
// Per-pair mailbox: one chunk of p2p space split between the peers.
int64_t mailboxFor(int size, int64_t chunk) {
  return std::max<int64_t>(kMinMailbox, chunk / std::max(size, 1) / 64 * 64);
}
MsgHeader* boxHeader(ShmSegmentHeader* h, int dst) {
  return reinterpret_cast<MsgHeader*>(h + 1) + dst;
}
Counter* p2pCounters(ShmSegmentHeader* h, int size) {
  return reinterpret_cast<Counter*>(boxHeader(h, size));
}
}  // namespace

int64_t ShmBridge::segmentBytes(int size, int64_t chunkBytes) {
  const int64_t chunk = chunkFor(size, chunkBytes);
  return headerBytes(size) + kSlots * 2 * chunk + size * mailboxFor(size, chunk);
}

ShmBridge::ShmBridge(int rank, int size, ShmBridgeOptions options,
                     std::chrono::milliseconds timeout)
    : rank_(rank),
      size_(size),
      pids_(std::move(options.pids)),
      peers_(size),
      spinMicros_(options.spinMicros),
      oversubscribed_(size > usableCores()),
      deadAfter_(std::clamp<std::chrono::milliseconds>(timeout / 4, std::chrono::seconds(2),
                                                       std::chrono::seconds(15))),
      beats_(size) {
  chunk_ = chunkFor(size, options.chunkBytes);
  mailbox_ = mailboxFor(size, chunk_);
  dataOff_ = headerBytes(size);
  segBytes_ = segmentBytes(size, options.chunkBytes);
  myName_ = options.name;
  const auto& store = options.store;
  TORCH_CHECK(myName_.rfind("/kaitian-", 0) == 0 && myName_.find('/', 1) == std::string::npos,
              "kaitian: bad shared memory name ", myName_);
  const uid_t me = ::geteuid();

  try {
    // O_EXCL: never adopt a segment someone else made under our name.
    const int fd = ::shm_open(myName_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    TORCH_CHECK(fd >= 0, sysError("kaitian: cannot create shared memory " + myName_ +
                                  " (is /dev/shm mounted and writable?)"));
    ::fchmod(fd, 0600);
    // Reserve the pages now: ftruncate alone reserves nothing on tmpfs, and a
    // full /dev/shm would then be a SIGBUS at the first touch.
    const int reserveErr = ::posix_fallocate(fd, 0, static_cast<off_t>(segBytes_));
    if (reserveErr != 0) {
      errno = reserveErr;
      const std::string msg = sysError(
          "kaitian: cannot reserve " + std::to_string(segBytes_) + " bytes of shared memory for " +
          myName_ + " (is /dev/shm full? free space there, or lower KAITIAN_CHUNK_BYTES; "
          "kaitianrun's docker workers share the host's /dev/shm)");
      ::close(fd);
      TORCH_CHECK(false, msg);
    }
    void* p = ::mmap(nullptr, segBytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    TORCH_CHECK(p != MAP_FAILED, sysError("kaitian: cannot map shared memory " + myName_));
    peers_[rank].base = static_cast<uint8_t*>(p);
    // Fault in the header and the chunk slots now, not inside the first
    // collective; mailboxes get pages only if point-to-point is used.
    std::memset(p, 0, dataOff_ + kSlots * 2 * chunk_);
    auto* hdr = reinterpret_cast<ShmSegmentHeader*>(p);
    hdr->rank = rank;
    hdr->world = size;
    hdr->chunk = chunk_;
    hdr->mailbox = mailbox_;
    hdr->pid = ::getpid();
    std::atomic_thread_fence(std::memory_order_release);
    hdr->magic = kMagic;
    peers_[rank].hdr = hdr;
    hbThread_ = std::thread([this] { heartbeatLoop(); });

    store->set("kaitian/shm/" + std::to_string(rank),
               std::vector<uint8_t>(myName_.begin(), myName_.end()));
    for (int s = 0; s < size; ++s) {
      if (s == rank) continue;
      const std::string key = "kaitian/shm/" + std::to_string(s);
      store->wait({key}, timeout);
      auto raw = store->get(key);
      const std::string name(raw.begin(), raw.end());
      const std::string who = "rank " + std::to_string(s) + "'s shared memory " + name;
      TORCH_CHECK(name.rfind("/kaitian-", 0) == 0 && name.find('/', 1) == std::string::npos,
                  "kaitian: ", who, " is not a kaitian segment name");
      const int pfd = ::shm_open(name.c_str(), O_RDWR | O_NOFOLLOW, 0);
      TORCH_CHECK(pfd >= 0, sysError("kaitian: cannot open " + who));
      struct stat st{};
      std::string bad;
      if (::fstat(pfd, &st) != 0) {
        bad = sysError("fstat failed");
      } else if (st.st_uid != me) {
        bad = "it is owned by uid " + std::to_string(st.st_uid) + ", not " + std::to_string(me);
      } else if ((st.st_mode & 0077) != 0) {
        bad = "it is accessible to group/others (mode " + std::to_string(st.st_mode & 0777) + ")";
      } else if (static_cast<size_t>(st.st_size) != segBytes_) {
        bad = "it has " + std::to_string(st.st_size) + " bytes, expected " +
              std::to_string(segBytes_) +
              " (all ranks must use the same KAITIAN_CHUNK_BYTES and world size)";
      }
      if (!bad.empty()) {
        ::close(pfd);
        TORCH_CHECK(false, "kaitian: refusing ", who, ": ", bad);
      }
      void* q = ::mmap(nullptr, segBytes_, PROT_READ | PROT_WRITE, MAP_SHARED, pfd, 0);
      ::close(pfd);
      TORCH_CHECK(q != MAP_FAILED, sysError("kaitian: cannot map " + who));
      peers_[s].base = static_cast<uint8_t*>(q);
      auto* ph = reinterpret_cast<ShmSegmentHeader*>(q);
      TORCH_CHECK(ph->magic == kMagic && ph->rank == s && ph->world == size &&
                      ph->chunk == chunk_ && ph->mailbox == mailbox_,
                  "kaitian: ", who, " is not rank ", s, "'s segment of this process group "
                  "(magic, rank, world size or chunk size differ)");
      peers_[s].hdr = ph;
      beats_[s] = Beat{ph->heartbeat.v.load(std::memory_order_relaxed), Clock::now()};
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
    close();
    throw;
  }
}

ShmBridge::~ShmBridge() { close(); }

void ShmBridge::heartbeatLoop() {
  std::unique_lock<std::mutex> lock(hbMu_);
  while (!hbStop_) {
    peers_[rank_].hdr->heartbeat.v.fetch_add(1, std::memory_order_relaxed);
    hbCv_.wait_for(lock, std::chrono::milliseconds(100));
  }
}

void ShmBridge::close() {
  {
    std::lock_guard<std::mutex> lock(hbMu_);
    hbStop_ = true;
  }
  hbCv_.notify_all();
  if (hbThread_.joinable()) hbThread_.join();
  if (peers_[rank_].hdr != nullptr) {
    // Peers still waiting on us learn that we are gone, not just slow.
    uint32_t running = kRunning;
    peers_[rank_].hdr->state.compare_exchange_strong(running, kClosed);
    for (auto& p : peers_) {
      if (p.hdr) {
        wake(p.hdr->ev, true);
        wake(p.hdr->inbox, true);
      }
    }
  }
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

void ShmBridge::poison(const std::string& firstFailure) {
  auto* hdr = peers_[rank_].hdr;
  if (hdr == nullptr || poisoned_.exchange(true)) return;
  const size_t n = std::min(firstFailure.size(), kMaxFailureText);
  std::memcpy(hdr->failure, firstFailure.data(), n);
  hdr->failure[n] = '\0';
  hdr->state.store(kBroken, std::memory_order_release);
  // Wake everyone, wherever they sleep: they check the peers' state when they wake.
  for (auto& p : peers_) {
    if (p.hdr) {
      wake(p.hdr->ev, true);
      wake(p.hdr->inbox, true);
    }
  }
}

std::string ShmBridge::failureOf(int peer) const {
  const char* f = peers_[peer].hdr->failure;
  std::string out;
  for (size_t i = 0; i < kMaxFailureText && f[i] != '\0'; ++i) {
    out += (f[i] >= 32 && f[i] < 127) ? f[i] : '?';
  }
  return out.empty() ? "rank " + std::to_string(peer) + " reported an error" : out;
}

uint8_t* ShmBridge::inArea(int r, uint64_t round) const {
  return peers_[r].base + dataOff_ + (round % kSlots) * 2 * chunk_;
}
uint8_t* ShmBridge::outArea(int r, uint64_t round) const {
  return inArea(r, round) + chunk_;
}
uint8_t* ShmBridge::mailbox(int owner, int dst) const {
  return peers_[owner].base + dataOff_ + kSlots * 2 * chunk_ + dst * mailbox_;
}
std::atomic<uint64_t>& ShmBridge::p2pSent(int owner, int dst) const {
  return p2pCounters(peers_[owner].hdr, size_)[dst].v;
}
std::atomic<uint64_t>& ShmBridge::p2pAck(int owner, int src) const {
  return p2pCounters(peers_[owner].hdr, size_)[size_ + src].v;
}

void ShmBridge::signal() { wake(peers_[rank_].hdr->ev, false); }
void ShmBridge::ring(int r) { wake(peers_[r].hdr->inbox, false); }

std::string ShmBridge::goneText(int peer, const char* what) {
  const int64_t pid = peer < static_cast<int>(pids_.size()) ? pids_[peer] : -1;
  if (pid > 0) {
    if (pidAlive(pid)) return "";
    return "rank " + std::to_string(peer) + " (pid " + std::to_string(pid) +
           ") exited while this rank waited for its " + what +
           "; the job cannot continue (restart it; kaitianrun --max-restarts does so "
           "automatically)";
  }
  // Another pid namespace (another container): its heartbeat must keep moving.
  const uint64_t beat = peers_[peer].hdr->heartbeat.v.load(std::memory_order_relaxed);
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(beatMu_);
  Beat& b = beats_[peer];
  if (beat != b.value) {
    b = Beat{beat, now};
  } else if (now - b.seen > deadAfter_) {
    return "rank " + std::to_string(peer) + " stopped its heartbeat " + seconds(now - b.seen) +
           " s ago while this rank waited for its " + what +
           " (it died or is frozen; it runs in another pid namespace, so its pid cannot be checked)";
  }
  return "";
}

std::vector<uint32_t> ShmBridge::peerStates() const {
  std::vector<uint32_t> states(size_, kRunning);
  for (int s = 0; s < size_; ++s) {
    if (s != rank_) states[s] = peers_[s].hdr->state.load(std::memory_order_acquire);
  }
  return states;
}

void ShmBridge::checkPeers(const std::vector<uint32_t>& states, int watch, const Deadline& dl, const char* what) {
  for (int s = 0; s < size_; ++s) {
    if (s == rank_) continue;
    const uint32_t st = states[s];
    if (st == kBroken) dl.peerFailed(failureOf(s));
    // A closed peer matters only when we wait for that one (any-source receives
    // go on while other senders remain).
    if (st == kClosed && watch == s) dl.breakGroup(peerGoneText(s, what));
  }
}

std::string ShmBridge::watchPeers(const std::vector<int>& with, const Deadline& dl,
                                  const std::string& what) {
  checkPeers(peerStates(), -1, dl, what.c_str());
  // A peer in another op would leave the vendor's step hanging until the
  // deadline: the op each rank published names the mismatch at once.
  publishOp(dl.id);
  for (int s = 0; s < size_ && dl.id.seq > 0; ++s) {
    OpId theirs;
    if (s != rank_ && peerOp(s, theirs) && theirs.seq == dl.id.seq && !theirs.sameCall(dl.id)) {
      dl.breakGroup(mismatchText(rank_, dl.id, s, theirs));
    }
  }
  for (int s : with) {
    if (s == rank_) continue;
    std::string gone = whyGone(s, dl, what);
    if (!gone.empty()) return gone;
  }
  return "";
}

std::string ShmBridge::whyGone(int peer, const Deadline& dl, const std::string& what) {
  const uint32_t st = peers_[peer].hdr->state.load(std::memory_order_acquire);
  if (st == kBroken) dl.peerFailed(failureOf(peer));
  if (st == kClosed) return peerGoneText(peer, what.c_str());
  return goneText(peer, what.c_str());
}

template <typename Ready>
void ShmBridge::waitUntil(Ready ready, ShmEventWord& ev, int watch, const Deadline& dl,
                          const char* what) {
  if (ready()) return;
  auto lastAlive = Clock::now();
  // Between spins and sleeps: the peers' fail-stop state, their liveness (every
  // kAliveEvery) and the deadline. True: the wait is over after all. A peer
  // may publish and then close the group or exit (the end of a job): what it
  // published is visible once its end is. So its end is read first and the
  // data looked at once more before the end is reported; reported in the other
  // order, a rank stopped between the two looks failed a finished collective.
  auto checks = [&] {
    const auto states = peerStates();
    std::string gone;
    const auto now = Clock::now();
    if (now - lastAlive > kAliveEvery) {
      for (int s = 0; s < size_ && gone.empty(); ++s) {
        if (s != rank_ && (watch < 0 || watch == s)) gone = goneText(s, what);
      }
      lastAlive = now;
    }
    if (ready()) return true;
    checkPeers(states, watch, dl, what);
    if (!gone.empty()) dl.breakGroup(gone);
    dl.check(watch < 0 ? std::string("a ") + what + " from any rank"
                       : "rank " + std::to_string(watch) + "'s " + what);
    return false;
  };
  if (oversubscribed_) {
    // More ranks than cores: the peer we wait for most likely waits for our
    // core. Spinning would keep it from running; hand the core over a few
    // times, then sleep.
    for (int i = 0; i < kOversubscribedYields && spinMicros_ > 0; ++i) {
      sched_yield();
      if (ready()) return;
    }
  } else {
    // Short spin: a peer in the same collective usually arrives within microseconds.
    const auto spinUntil = Clock::now() + std::chrono::microseconds(spinMicros_);
    for (int i = 0;; ++i) {
      if (ready()) return;
      KAITIAN_CPU_RELAX();
      if ((i & 127) == 127) {
        if (Clock::now() >= spinUntil) break;
        if ((i & 4095) == 4095) {
          sched_yield();  // let a descheduled peer run
          if (checks()) return;
        }
      }
    }
  }
  while (true) {
    const uint32_t seen = ev.seq.load(std::memory_order_seq_cst);
    if (ready()) return;
    ev.waiters.fetch_add(1, std::memory_order_seq_cst);
    if (ready()) {
      ev.waiters.fetch_sub(1, std::memory_order_seq_cst);
      return;
    }
    futexWait(&ev.seq, seen, kSleepNanos);
    ev.waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (ready() || checks()) return;
  }
}

void ShmBridge::waitAtLeast(int peer, const std::atomic<uint64_t>& ctr, uint64_t target,
                            const Deadline& dl, const char* what) {
  if (ctr.load(std::memory_order_acquire) >= target) return;
  waitUntil([&] { return ctr.load(std::memory_order_acquire) >= target; }, peers_[peer].hdr->ev,
            peer, dl, what);
}

void ShmBridge::publishOp(const OpId& id) {
  if (id.seq == 0 || id.seq == publishedSeq_) return;  // (p2p ops are not numbered)
  ShmSegmentHeader* h = peers_[rank_].hdr;
  const uint64_t v = h->opVersion.load(std::memory_order_relaxed);
  h->opVersion.store(v + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  std::memcpy(&h->op, &id, sizeof(id));
  h->opVersion.store(v + 2, std::memory_order_release);
  publishedSeq_ = id.seq;
  // Store, then load the peers' (watchPeers): of two ranks publishing at
  // once, at least one sees the other's op.
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

bool ShmBridge::peerOp(int peer, OpId& out) const {
  const ShmSegmentHeader* h = peers_[peer].hdr;
  const uint64_t v = h->opVersion.load(std::memory_order_acquire);
  if (v == 0 || (v & 1) != 0) return false;  // none yet, or being rewritten
  std::memcpy(&out, &h->op, sizeof(out));
  std::atomic_thread_fence(std::memory_order_acquire);
  return h->opVersion.load(std::memory_order_relaxed) == v;
}

void ShmBridge::beginCall(const Deadline& dl) {
  TORCH_CHECK(peers_[rank_].hdr != nullptr, "kaitian ", dl.what, ": the bridge is closed");
  if (dl.fail && dl.fail->broken()) dl.fail->raise(dl.what);
  publishOp(dl.id);
  for (int s = 0; s < size_; ++s) {
    if (s != rank_ && peers_[s].hdr->state.load(std::memory_order_acquire) == kBroken) {
      dl.peerFailed(failureOf(s));
    }
  }
  ++calls_;
}

void ShmBridge::publishRound(uint64_t t, Kind kind, const Deadline& dl) {
  auto& slot = peers_[rank_].hdr->slot[t % kSlots];
  slot.call = calls_;
  slot.round = t;
  slot.kind = kind;
  slot.id = dl.id;
  // the caller's release store of `pub` publishes this header with the data
}

void ShmBridge::checkRound(int peer, uint64_t t, Kind kind, const Deadline& dl) {
  const SlotHeader& h = peers_[peer].hdr->slot[t % kSlots];
  if (h.id.sameCall(dl.id) && h.call == calls_ && h.round == t && h.kind == kind) return;
  if (!h.id.sameCall(dl.id)) dl.breakGroup(mismatchText(rank_, dl.id, peer, h.id));
  dl.breakGroup("rank " + std::to_string(peer) + " is at bridge call " + std::to_string(h.call) +
                " round " + std::to_string(h.round) + " but this rank at call " +
                std::to_string(calls_) + " round " + std::to_string(t) + " of " +
                dl.id.describe() + " (the ranks' op sequences diverged)");
}

void ShmBridge::awaitSlot(uint64_t t, const Deadline& dl) {
  if (t < static_cast<uint64_t>(kSlots)) return;
  for (int s = 0; s < size_; ++s) {
    if (s != rank_) waitAtLeast(s, peers_[s].hdr->gathered.v, t - kSlots + 1, dl, "previous round");
  }
}

uint64_t ShmBridge::beginRound(const Deadline& dl) {
  awaitSlot(round_, dl);
  return round_;
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
  beginCall(dl);
  const int64_t n = spec.buf.numel();
  const int64_t es = static_cast<int64_t>(spec.buf.element_size());
  const int64_t ce = std::max<int64_t>(1, chunk_ / es);
  auto* base = static_cast<uint8_t*>(spec.buf.data_ptr());
  const int myG = spec.groupOf[rank_];
  const Range pubRange = publishRange(spec, rank_);
  auto* hdr = peers_[rank_].hdr;
  // Round first + k carries slice k of every rank's stripe (slices laid out in
  // rank order in a slot), so that every rank publishes, reduces and gathers a
  // share of every round. (Whole stripes in buffer order left one rank
  // reducing each round while the others waited: the work did not spread
  // over the ranks' cores.) The slices of a round fit one chunk.
  int64_t striped = 0;
  for (const Range& r : spec.stripes) striped += r.size();
  const int64_t perRound = std::max<int64_t>(1, ce - size_);  // slices round up by < 1 element each
  const int64_t rounds = n == 0 ? 0 : std::max<int64_t>(1, (striped + perRound - 1) / perRound);
  const uint64_t first = round_;
  std::vector<Range> slice(size_);
  std::vector<int64_t> offset(size_);
  auto layout = [&](int64_t k) {
    int64_t off = 0;
    for (int r = 0; r < size_; ++r) {
      const Range part = evenPart(spec.stripes[r].size(), rounds, k);
      slice[r] = Range{spec.stripes[r].begin + part.begin, spec.stripes[r].begin + part.end};
      offset[r] = off;
      off += slice[r].size();
    }
  };
  // 1. Publish the part of our group's partial that other groups' reducers need.
  auto publish = [&](int64_t k) {
    const uint64_t t = first + k;
    awaitSlot(t, dl);
    layout(k);
    uint8_t* in = inArea(rank_, t);
    for (int r = 0; r < size_; ++r) {
      if (spec.groupOf[r] == myG) continue;  // reduces our group's partial from its own buf
      const Range piece = pubRange.intersect(slice[r]);
      if (piece.size() > 0) {
        std::memcpy(in + (offset[r] + piece.begin - slice[r].begin) * es, base + piece.begin * es,
                    piece.size() * es);
      }
    }
    publishRound(t, kReduce, dl);
    hdr->pub.v.store(t + 1, std::memory_order_release);
    signal();
  };
  // 3. Copy the peers' reduced slices of round k into buf.
  auto gather = [&](int64_t k) {
    if (!spec.gather) return;
    const uint64_t t = first + k;
    layout(k);
    for (int s = 0; s < size_; ++s) {
      if (s == rank_ || slice[s].size() == 0) continue;
      waitAtLeast(s, peers_[s].hdr->reduced.v, t + 1, dl, "reduced stripe");
      checkRound(s, t, kReduce, dl);
      std::memcpy(base + slice[s].begin * es, outArea(s, t), slice[s].size() * es);
    }
  };
  // Each round's data is published one round ahead of its reduction and
  // gathered one round after it, so a rank waits only for a peer a whole
  // round behind, not for every peer at every round's start.
  std::vector<const void*> srcs;
  if (rounds > 0) publish(0);
  for (int64_t k = 0; k < rounds; ++k) {
    const uint64_t t = first + k;
    if (k + 1 < rounds) publish(k + 1);
    if (k == 0) {
      // Every rank checks every peer's first round, so that each of them
      // raises if any rank is in another collective.
      for (int s = 0; s < size_; ++s) {
        if (s == rank_) continue;
        waitAtLeast(s, peers_[s].hdr->pub.v, t + 1, dl, "arrival");
        checkRound(s, t, kReduce, dl);
      }
    }
    // 2. Reduce our slice: own partial from buf, other groups' from their owners.
    layout(k);
    const Range mine = slice[rank_];
    const int64_t myOff = offset[rank_];
    int64_t x = mine.begin;
    while (x < mine.end) {
      int64_t y = mine.end;
      srcs.assign(1, base + x * es);
      for (int g = 0; g < static_cast<int>(spec.groups.size()); ++g) {
        if (g == myG) continue;
        auto [owner, stripe] = detail::ownerOf(spec, g, n, x);
        y = std::min(y, stripe.end);
        waitAtLeast(owner, peers_[owner].hdr->pub.v, t + 1, dl, "published data");
        checkRound(owner, t, kReduce, dl);
        srcs.push_back(inArea(owner, t) + (myOff + x - mine.begin) * es);
      }
      spec.reducer(srcs, y - x, base + x * es,
                   spec.gather ? outArea(rank_, t) + (x - mine.begin) * es : nullptr);
      x = y;
    }
    hdr->reduced.v.store(t + 1, std::memory_order_release);
    signal();
    if (k > 0) {
      gather(k - 1);
      hdr->gathered.v.store(t, std::memory_order_release);  // rounds < t are done
      signal();
    }
  }
  if (rounds > 0) {
    gather(rounds - 1);
    endRound(first + rounds - 1);
  }
}

void ShmBridge::exchange(const ExchangeSpec& spec, const Deadline& dl) {
  beginCall(dl);
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
  publishRound(t, kExchange, dl);
  hdr->pub.v.store(t + 1, std::memory_order_release);
  signal();
  std::vector<const int64_t*> metas(W);
  for (int s = 0; s < W; ++s) {
    if (s != rank_) {
      waitAtLeast(s, peers_[s].hdr->pub.v, t + 1, dl, "arrival");
      checkRound(s, t, kExchange, dl);
    }
    metas[s] = reinterpret_cast<const int64_t*>(inArea(s, t));
  }
  // Every rank checks every rank's plan (so all raise alike): pieces inside the
  // sender's blob, and what s sends to d is what d expects from s.
  constexpr int64_t kMaxBlob = int64_t{1} << 48;
  int64_t maxLen = 0;
  std::string bad;
  for (int s = 0; s < W && bad.empty(); ++s) {
    const int64_t blobLen = metas[s][0];
    if (blobLen < 0 || blobLen > kMaxBlob) {
      bad = "rank " + std::to_string(s) + " announced a blob of " + std::to_string(blobLen) +
            " bytes";
      break;
    }
    maxLen = std::max(maxLen, blobLen);
    for (int d = 0; d < W && bad.empty(); ++d) {
      const int64_t off = metas[s][1 + d], len = metas[s][1 + W + d];
      if (off < 0 || len < 0 || len > blobLen || off > blobLen - len) {
        bad = "rank " + std::to_string(s) + " announced a piece [" + std::to_string(off) + ", +" +
              std::to_string(len) + ") outside its " + std::to_string(blobLen) + "-byte blob";
      } else if (len != metas[d][1 + 2 * W + s]) {
        bad = sizeMismatchText(dl.id, s, d, len, metas[d][1 + 2 * W + s]);
      }
    }
  }
  std::vector<int64_t> offFrom(W), lenFrom(W);
  for (int s = 0; s < W; ++s) {
    offFrom[s] = metas[s][1 + rank_];
    lenFrom[s] = metas[s][1 + W + rank_];
  }
  endRound(t);
  if (!bad.empty()) dl.breakGroup(bad);
  const int64_t rounds = (maxLen + chunk_ - 1) / chunk_;
  for (int64_t k = 0; k < rounds; ++k) {
    t = beginRound(dl);
    const Range win = Range{k * chunk_, (k + 1) * chunk_}.intersect(Range{0, spec.blobLen});
    if (win.size() > 0) std::memcpy(inArea(rank_, t), spec.blob + win.begin, win.size());
    publishRound(t, kExchange, dl);
    hdr->pub.v.store(t + 1, std::memory_order_release);
    signal();
    for (int s = 0; s < W; ++s) {
      if (s == rank_ || lenFrom[s] == 0) continue;
      const Range need = Range{offFrom[s], offFrom[s] + lenFrom[s]}.intersect(
          Range{k * chunk_, (k + 1) * chunk_});
      if (need.size() == 0) continue;
      waitAtLeast(s, peers_[s].hdr->pub.v, t + 1, dl, "data");
      checkRound(s, t, kExchange, dl);
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
  if (dl.fail && dl.fail->broken()) dl.fail->raise(dl.what);
  auto* src = static_cast<const uint8_t*>(data);
  auto& inbox = peers_[rank_].hdr->inbox;
  int64_t off = 0;
  do {
    auto& sent = p2pSent(rank_, dst);
    const uint64_t seq = sent.load(std::memory_order_relaxed);
    auto& ack = p2pAck(dst, rank_);
    waitUntil([&] { return ack.load(std::memory_order_acquire) >= seq; }, inbox, dst, dl,
              "receive");
    const int64_t len = std::min(mailbox_, bytes - off);
    auto* h = boxHeader(peers_[rank_].hdr, dst);
    h->seq = seq + 1;
    h->tag = tag;
    h->total = bytes;
    h->offset = off;
    h->len = len;
    if (len > 0) std::memcpy(mailbox(rank_, dst), src + off, len);
    sent.store(seq + 1, std::memory_order_release);
    ring(dst);
    off += len;
  } while (off < bytes);
}

int ShmBridge::recv(int src, void* data, int64_t bytes, int tag, const Deadline& dl) {
  TORCH_CHECK(peers_[rank_].hdr != nullptr, "kaitian recv: the bridge is closed");
  if (dl.fail && dl.fail->broken()) dl.fail->raise(dl.what);
  auto& inbox = peers_[rank_].hdr->inbox;
  auto pending = [&](int s) {
    return p2pSent(s, rank_).load(std::memory_order_acquire) >
           p2pAck(rank_, s).load(std::memory_order_relaxed);
  };
  if (src < 0) {
    // Any source: sleep on our inbox word, which every sender rings.
    waitUntil(
        [&] {
          for (int s = 0; s < size_ && src < 0; ++s) {
            if (s != rank_ && pending(s)) src = s;
          }
          return src >= 0;
        },
        inbox, -1, dl, "message");
  }
  auto* out = static_cast<uint8_t*>(data);
  const std::string from = "rank " + std::to_string(src);
  int64_t off = 0;
  do {
    auto& ack = p2pAck(rank_, src);
    const uint64_t seq = ack.load(std::memory_order_relaxed);
    waitUntil([&] { return pending(src); }, inbox, src, dl, "send");
    const MsgHeader h = *boxHeader(peers_[src].hdr, rank_);
    if (h.seq != seq + 1 || h.offset != off || h.len < 0 || h.len > mailbox_ ||
        h.len > h.total - h.offset || (h.len == 0 && h.total != 0)) {
      dl.breakGroup(from + " sent a malformed message (piece " + std::to_string(h.seq) +
                    ", offset " + std::to_string(h.offset) + ", " + std::to_string(h.len) +
                    " B) where piece " + std::to_string(seq + 1) + " at offset " +
                    std::to_string(off) + " was due");
    }
    if (h.tag != tag) {
      dl.breakGroup("the next message from " + from + " has tag " + std::to_string(h.tag) +
                    " but recv expects tag " + std::to_string(tag) +
                    "; kaitian delivers messages between two ranks in order, so post receives "
                    "in the order the sends were issued");
    }
    if (h.total != bytes) {
      dl.breakGroup(from + " sent " + std::to_string(h.total) +
                    " bytes but the receive tensor holds " + std::to_string(bytes) +
                    " bytes; use the same shape and dtype on both sides");
    }
    if (h.len > 0) std::memcpy(out + h.offset, mailbox(src, rank_), h.len);
    off = h.offset + h.len;
    ack.store(seq + 1, std::memory_order_release);
    ring(src);
  } while (off < bytes);
  return src;
}

}  // namespace kaitian
