// KaitianBackend: argument checks happen on the caller's thread (bad input fails
// at once, naming the op); the communication itself runs on the op queues.
#include "backend.hpp"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <condition_variable>
#include <map>
#include <numeric>
#include <optional>
#include <thread>

namespace kaitian {

using c10d::OpType;
using RedOp = c10d::ReduceOp;

namespace {

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }
uint8_t* bytesOf(const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

// Data movement stages device tensors in pageable host memory with blocking
// copies on the op's stream (no pinned buffer as large as the tensor per call);
// reductions, the large-volume path, go through reused pinned segment buffers.
// The host first waited, under the op's deadline, for the device work the op
// depends on (enqueue), so a blocking copy waits for nothing but itself.

// A contiguous host tensor holding t's values (t itself when it already is one).
at::Tensor hostCopyOf(const at::Tensor& t) {
  if (t.is_cpu()) return t.contiguous();
  return t.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true, at::MemoryFormat::Contiguous);
}

// A contiguous host tensor to receive t's new values into (t itself if possible).
at::Tensor hostBufferFor(const at::Tensor& t) {
  if (t.is_cpu() && t.is_contiguous()) return t;
  return at::empty(t.sizes(), t.options().device(at::kCPU));
}

// Copies h back into t; returns once a device copy has finished reading h.
void writeBack(at::Tensor& t, const at::Tensor& h) {
  if (t.is_cpu() && h.data_ptr() == t.data_ptr() && t.is_contiguous()) return;
  t.copy_(h.view(t.sizes()));
}

// Waits for a device event without blocking in the driver, so that the
// deadline and shutdown/abort are noticed (a peer missing from a vendor
// collective queued before it would otherwise hold this thread forever).
// `watch` (if any) runs between polls too, every few milliseconds.
void waitEvent(const c10::Event& ev, const Deadline& dl, const std::string& what,
               const std::function<void()>& watch = {}) {
  const auto spinUntil = Clock::now() + std::chrono::microseconds(50);
  auto nextWatch = Clock::now();
  while (!ev.query()) {
    dl.check(what);
    if (watch && Clock::now() >= nextWatch) {
      watch();
      nextWatch = Clock::now() + std::chrono::milliseconds(2);
    }
    if (Clock::now() < spinUntil) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

// Orders the progress thread's device work after what the caller queued so far
// (`ready`, recorded on the caller's current stream).
struct DeviceSync {
  DeviceSync(c10::Device d, c10::Stream s) : device(d), side(s), ready(d.type()) {}
  c10::Device device;
  c10::Stream side;
  c10::Event ready;
};

// `device`: the op's device when no tensor names one (a barrier's).
std::shared_ptr<DeviceSync> makeDeviceSync(const std::vector<at::Tensor>& tensors, const char* op,
                                           std::optional<c10::Device> device) {
  std::optional<c10::Device> dev;
  for (const auto& t : tensors) {
    if (!t.defined() || t.is_cpu()) continue;
    if (!dev) {
      dev = t.device();
    } else {
      TORCH_CHECK(*dev == t.device(), "kaitian ", op, ": tensors on ", *dev, " and ", t.device(),
                  "; kaitian drives one device per process, move them to one device");
    }
  }
  if (!dev) dev = device;
  if (!dev) return nullptr;
  c10::impl::VirtualGuardImpl impl(dev->type());
  auto sync = std::make_shared<DeviceSync>(*dev, impl.getStreamFromGlobalPool(*dev));
  sync->ready.record(impl.getStream(*dev));
  // The op reads and writes the user's tensors on the side stream: their memory
  // must not be reused by the caller's stream before that work is done.
  auto record = [&](const at::Tensor& x) {
    if (x.defined() && x.has_storage()) impl.recordDataPtrOnStream(x.storage().data_ptr(), sync->side);
  };
  for (const auto& t : tensors) {
    if (!t.defined() || t.is_cpu()) continue;
    if (t.is_sparse()) {
      record(t._indices());
      record(t._values());
    } else {
      record(t);
    }
  }
  return sync;
}

}  // namespace

// Two pinned host buffers that one device's segments pass through on the
// collectives thread, each at most one segment, reused across calls. landed[i]:
// the copy into buffer i arrived; freed[i]: the copy out of it finished (the
// buffer may be refilled); back: the last copy back, which the op's stream
// waits for. One ring per device: an event belongs to the device it first
// recorded on.
struct PinnedRing {
  explicit PinnedRing(c10::DeviceType type) : back(type) {
    for (int i = 0; i < 2; ++i) {
      landed.emplace_back(type);
      freed.emplace_back(type);
    }
  }
  at::Tensor slot(int i, int64_t len, at::ScalarType dtype) const {
    return buf[i].narrow(0, 0, len * static_cast<int64_t>(c10::elementSize(dtype))).view(dtype);
  }
  at::Tensor buf[2];
  std::vector<c10::Event> landed, freed;
  c10::Event back;
};

namespace {

// Names in the vendor-gap table of kaitian/backend/factory.py.
const std::map<std::string, at::ScalarType>& gapDtypeNames() {
  static const std::map<std::string, at::ScalarType> names{
      {"float32", at::kFloat}, {"float64", at::kDouble}, {"float16", at::kHalf},
      {"bfloat16", at::kBFloat16}, {"int8", at::kChar}, {"int16", at::kShort},
      {"int32", at::kInt}, {"int64", at::kLong}, {"uint8", at::kByte}, {"bool", at::kBool}};
  return names;
}

std::optional<RedOp::RedOpType> gapOpNamed(const std::string& name) {
  for (auto op : {RedOp::SUM, RedOp::AVG, RedOp::PRODUCT, RedOp::MIN, RedOp::MAX, RedOp::BAND,
                  RedOp::BOR, RedOp::BXOR, RedOp::PREMUL_SUM}) {
    if (name == reduceOpName(op)) return op;
  }
  return std::nullopt;
}

void checkSameKind(const char* op, const at::Tensor& ref, const at::Tensor& t,
                   int64_t numel, const char* what) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "kaitian ", op, ": ", what, " has dtype ",
              t.scalar_type(), " but the input has ", ref.scalar_type(),
              "; use the same dtype");
  TORCH_CHECK(t.numel() == numel, "kaitian ", op, ": ", what, " has ", t.numel(),
              " elements, expected ", numel, "; check the tensor shapes");
  TORCH_CHECK(t.layout() == at::kStrided, "kaitian ", op,
              ": sparse tensors are not supported; call .to_dense() first");
}

// The identity of an op as every rank must agree on it (see OpId).
OpId makeId(OpType type, int32_t dtype, int64_t bytes, int64_t root, int32_t redop) {
  OpId id;
  id.type = static_cast<int32_t>(type);
  id.dtype = dtype;
  id.bytes = bytes;
  id.root = root;
  id.redop = redop;
  return id;
}
OpId opId(OpType type) { return makeId(type, -1, 0, -1, -1); }
OpId opId(OpType type, at::ScalarType dtype, int64_t bytes) {
  return makeId(type, static_cast<int32_t>(dtype), bytes, -1, -1);
}
OpId opId(OpType type, const at::Tensor& t, int64_t root = -1) {
  return makeId(type, static_cast<int32_t>(t.scalar_type()), nbytes(t), root, -1);
}
OpId opId(OpType type, const at::Tensor& t, int64_t root, const RedOp& op) {
  return makeId(type, static_cast<int32_t>(t.scalar_type()), nbytes(t), root, op.op_);
}
OpId opId(OpType type, const std::vector<at::Tensor>& ts, int64_t root = -1, int32_t redop = -1) {
  int64_t bytes = 0;
  for (const auto& t : ts) bytes += nbytes(t);
  return makeId(type, ts.empty() ? -1 : static_cast<int32_t>(ts[0].scalar_type()), bytes, root,
                redop);
}
OpId opId(OpType type, const std::vector<at::Tensor>& ts, int64_t root, const RedOp& op) {
  return opId(type, ts, root, static_cast<int32_t>(op.op_));
}

// Part `i` of [0, total) when it is split in proportion to `weights`.
Range weightedPart(int64_t total, const std::vector<int64_t>& weights, size_t i) {
  int64_t sum = 0, before = 0;
  for (size_t r = 0; r < weights.size(); ++r) {
    sum += weights[r];
    if (r < i) before += weights[r];
  }
  auto at = [&](int64_t w) {
    return static_cast<int64_t>(static_cast<__int128>(total) * w / sum);
  };
  return Range{at(before), at(before + weights[i])};
}

// OpId::stripes of an all_reduce with these stripe weights: 0 when even.
uint32_t stripeDigest(const std::vector<int64_t>& weights) {
  if (weights.empty()) return 0;
  uint32_t h = 2166136261u;  // FNV-1a over the weights' bytes
  for (int64_t w : weights) {
    for (int b = 0; b < 8; ++b) {
      h ^= static_cast<uint8_t>(static_cast<uint64_t>(w) >> (8 * b));
      h *= 16777619u;
    }
  }
  return h == 0 ? 1 : h;
}

// The text of the error an op body threw.
std::string errorText(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& err) {
    return err.what_without_backtrace();
  } catch (const std::exception& err) {
    return err.what();
  } catch (...) {
    return "unknown error";
  }
}

// The non-empty ranges covering a and b, in order (merged when they touch).
std::vector<Range> unionOf(Range a, Range b) {
  std::vector<Range> out;
  if (a.size() == 0 || (b.size() > 0 && b.begin < a.begin)) std::swap(a, b);
  if (a.size() == 0) return out;
  if (b.size() > 0 && b.begin <= a.end) {
    out.push_back(Range{a.begin, std::max(a.end, b.end)});
  } else {
    out.push_back(a);
    if (b.size() > 0) out.push_back(b);
  }
  return out;
}

void checkOne(const char* op, size_t n) {
  TORCH_CHECK(n == 1, "kaitian ", op, ": expects exactly one tensor per rank, got ", n,
              " (kaitian drives one device per process)");
}

}  // namespace

KaitianBackend::KaitianBackend(int rank, int size, std::chrono::milliseconds timeout,
                               Layout layout, c10::intrusive_ptr<c10d::Backend> intraDevice,
                               c10::intrusive_ptr<c10d::Backend> intraCpu,
                               std::unique_ptr<Bridge> bridge)
    : c10d::Backend(rank, size),
      layout_(std::move(layout)),
      intraDevice_(std::move(intraDevice)),
      intraCpu_(std::move(intraCpu)),
      bridge_(std::move(bridge)),
      timeoutMs_(timeout.count()),
      fail_(rank) {
  TORCH_CHECK(static_cast<int>(layout_.groupOf.size()) == size,
              "kaitian: layout has ", layout_.groupOf.size(), " ranks, world has ", size);
  TORCH_CHECK(size == 1 || bridge_ != nullptr, "kaitian: a bridge is required for world size > 1");
  const size_t G = layout_.groupNames.size();
  TORCH_CHECK(layout_.vendorGaps.empty() || layout_.vendorGaps.size() == G, "kaitian: ",
              layout_.vendorGaps.size(), " vendor-gap lists for ", G, " groups");
  gaps_.resize(G);
  for (size_t g = 0; g < layout_.vendorGaps.size(); ++g) {
    for (const auto& name : layout_.vendorGaps[g]) {
      const auto dt = gapDtypeNames().find(name);
      const auto op = gapOpNamed(name);
      TORCH_CHECK(dt != gapDtypeNames().end() || op, "kaitian: unknown dtype or reduce op '",
                  name, "' in the vendor-gap table");
      if (op) {
        gaps_[g].ops.push_back(*op);
      } else {
        gaps_[g].dtypes.push_back(dt->second);
      }
    }
  }
  for (int r = 0; r < size; ++r) {
    if (layout_.groupOf[r] == layout_.groupOf[rank]) groupMembers_.push_back(r);
  }
  collectives_ = std::make_unique<OpQueue>("kaitian-coll");
  sends_ = std::make_unique<OpQueue>("kaitian-send");
  recvs_ = std::make_unique<OpQueue>("kaitian-recv");
}

KaitianBackend::~KaitianBackend() { shutdown(); }

void KaitianBackend::shutdown() { stopAll(false); }

void KaitianBackend::abort() { stopAll(true); }

void KaitianBackend::stopAll(bool abort) {
  std::lock_guard<std::mutex> lock(shutdownMu_);
  if (shutDown_) return;
  shutDown_ = true;
  // A send not waited for is delivered first (a re-balancer's last state to a hot spare
  // as the job ends): the receiver would otherwise fail, its peer gone.
  if (!abort && sends_) sends_->drain();
  // Wake the waiting threads first: every wait of ours polls stop_ (bridge
  // waits within 100 ms, vendor steps and device events within 10 ms). On abort
  // the vendors abort their own waits too (NCCL aborts its communicators).
  stop_.store(true);
  if (abort) {
    if (intraDevice_) compat::abortBackend(*intraDevice_);
    if (intraCpu_) compat::abortBackend(*intraCpu_);
  }
  for (auto* q : {collectives_.get(), sends_.get(), recvs_.get()}) {
    if (q) q->stop(abort ? "the process group was aborted" : "the process group was shut down");
  }
  if (bridge_) bridge_->close();
  for (auto* vendor : {&intraDevice_, &intraCpu_}) {
    if (!*vendor) continue;
    if (!abort) compat::shutdownBackend(**vendor);
    // A vendor whose op we gave up on still waits for the missing peer on its
    // own threads (gloo has no abort) and would join them at destruction, up
    // to its timeout: leave it to the process instead of blocking here.
    std::lock_guard<std::mutex> l(abandonedMu_);
    if (abandoned_.count(vendor->get()) != 0) (void)vendor->release();
  }
}

void KaitianBackend::runVendor(const c10::intrusive_ptr<c10d::Backend>& vendor,
                               const std::function<c10::intrusive_ptr<c10d::Work>()>& start,
                               const c10::Device& device, const Deadline& dl) {
  const std::string step = "the intra-group step (" + vendor->getBackendName() + ")";
  if (bridge_) bridge_->watchPeers({}, dl, step);
  const c10::intrusive_ptr<c10d::Work> work = start();
  // A vendor op we stop waiting for keeps waiting for its peer on the
  // vendor's threads or device: shutdown leaves that vendor to the process.
  auto giveUp = [&] {
    std::lock_guard<std::mutex> l(abandonedMu_);
    abandoned_.insert(vendor.get());
  };
  // The vendor knows nothing of kaitian's fail-stop: a peer that broke the
  // group, or a member of this group that died or left, would show only as
  // the vendor's hang until the deadline (or its transport error). The bridge
  // sees them: watch it while waiting. A member may leave right after its
  // share of the step, so a gone member counts only if the step does not then
  // finish within a short grace.
  const std::vector<int>& members = groupMembers_;
  // A device vendor reports what went wrong on the device through its Work
  // once done (NCCL: an asynchronous error).
  auto failedOnDevice = [&] { return work->isCompleted() && work->exception() != nullptr; };
  auto watch = [&](const std::function<bool()>& finished) {
    if (!bridge_) return;
    std::string gone;
    try {
      gone = bridge_->watchPeers(members, dl, step);
    } catch (...) {
      giveUp();
      throw;
    }
    if (gone.empty()) return;
    const auto grace = Clock::now() + std::chrono::milliseconds(200);
    while (Clock::now() < grace) {
      if (finished()) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    giveUp();
    dl.breakGroup(gone);
  };
  // The vendor's own wait may block up to its timeout, deaf to our abort (gloo
  // has none): wait for its future in slices that check the deadline and stop_.
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  try {
    fut = work->getFuture();
  } catch (const c10::Error&) {  // a plug-in without futures: its wait is all we have
    work->wait();
    return;
  }
  if (!fut->completed()) {
    struct Wake {
      std::mutex mu;
      std::condition_variable cv;
    };
    auto wake = std::make_shared<Wake>();
    fut->addCallback([wake](c10::ivalue::Future&) {
      std::lock_guard<std::mutex> l(wake->mu);
      wake->cv.notify_all();
    });
    std::unique_lock<std::mutex> lock(wake->mu);
    while (!fut->completed()) {
      try {
        dl.check(step);
      } catch (...) {
        giveUp();
        throw;
      }
      lock.unlock();
      watch([&] { return fut->completed(); });
      lock.lock();
      wake->cv.wait_for(lock, std::chrono::milliseconds(10));
    }
  }
  // Rethrows the vendor's error (a peer's failure or death named instead, when
  // the bridge knows of it); for device work, orders the current stream after it.
  try {
    work->wait();
  } catch (...) {
    watch([] { return false; });
    throw;
  }
  // The step finished here; if a peer broke the group meanwhile (it gave up
  // on this step before this rank arrived), this rank fails the step too.
  auto peersStillOk = [&] {
    if (bridge_) bridge_->watchPeers({}, dl, step);
  };
  if (device.is_cpu()) {
    peersStillOk();
    return;
  }
  // A device vendor's future completes once its kernel is queued (NCCL's), and
  // the kernel waits on the device for the peers: wait for it here, where the
  // deadline is checked, not in a later copy that would block without one.
  c10::impl::VirtualGuardImpl impl(device.type());
  c10::Event done(device.type());
  done.record(impl.getStream(device));
  try {
    waitEvent(done, dl, "the device work of " + step,
              [&] { watch([&] { return done.query() && !failedOnDevice(); }); });
    if (failedOnDevice()) {
      watch([] { return false; });  // a gone peer is the cause to name
      std::rethrow_exception(work->exception());
    }
  } catch (...) {
    giveUp();
    throw;
  }
  peersStillOk();
}

c10::intrusive_ptr<c10d::Backend> KaitianBackend::soleVendor(
    const std::vector<at::Tensor>& tensors, std::optional<RedOp::RedOpType> op) const {
  // Every rank in one vendor group: the vendor does the whole op, no host staging.
  if (!intraDevice_ || layout_.groupNames.size() != 1 || tensors.empty()) return {};
  for (const auto& t : tensors) {
    if (t.is_cpu() || !t.is_contiguous() || t.scalar_type() != tensors[0].scalar_type()) return {};
  }
  // AVG and PREMUL_SUM stay ours (kaitian scales and divides; not every vendor does).
  if (op && *op != RedOp::SUM && *op != RedOp::PRODUCT && *op != RedOp::MIN && *op != RedOp::MAX) {
    return {};
  }
  return groupUsesVendor(0, tensors[0].scalar_type(), op) ? intraDevice_
                                                          : c10::intrusive_ptr<c10d::Backend>();
}

PinnedRing& KaitianBackend::pinnedRing(const c10::Device& device, int64_t bytes) {
  auto& ring = rings_[device];
  if (!ring) ring = std::make_unique<PinnedRing>(device.type());
  for (auto& b : ring->buf) {
    // A replaced buffer goes back to torch's pinned cache, which keeps it until
    // the copies recorded on it finished.
    if (!b.defined() || b.numel() < bytes) b = compat::pinnedBytes(bytes, device.type());
  }
  return *ring;
}

c10::intrusive_ptr<c10d::Work> KaitianBackend::enqueue(OpQueue& queue, OpType type,
                                                       const char* name, OpId id,
                                                       std::vector<at::Tensor> outputs,
                                                       std::vector<at::Tensor> deviceTensors,
                                                       std::chrono::milliseconds timeout,
                                                       Body body,
                                                       std::optional<c10::Device> device) {
  TORCH_CHECK(!stop_.load(), "kaitian ", name,
              ": the process group was shut down; create a new one");
  if (fail_.broken()) fail_.raise(name);
  auto sync = makeDeviceSync(deviceTensors, name, device);
  std::vector<c10::Device> devices;
  if (sync) devices.push_back(sync->device);
  auto work = c10::make_intrusive<KaitianWork>(getRank(), type, name, devices);
  const auto limit =
      timeout.count() > 0 ? timeout : std::chrono::milliseconds(timeoutMs_.load());
  ++seq_;
  // Collectives are numbered alike on every rank (the bridge checks it).
  if (&queue == collectives_.get()) id.seq = ++collectiveSeq_;
  std::string opName(name);
  queue.push(OpQueue::Task{
      [this, work, sync, body = std::move(body), outputs = std::move(outputs), limit, opName,
       id]() {
        std::optional<c10::impl::VirtualGuardImpl> impl;
        std::optional<c10::Device> prevDevice;
        std::optional<c10::Stream> prevStream;
        try {
          if (sync) {
            impl.emplace(sync->device.type());
            prevDevice = impl->exchangeDevice(sync->device);
            prevStream = impl->exchangeStream(sync->side);
            sync->ready.block(sync->side);
          }
          if (fail_.broken()) fail_.raise(opName);  // broken while this op was queued
          const auto dl = Deadline::after(limit, opName, &stop_, &fail_, id);
          // The host touches the op's data only once the device work it
          // depends on is done: waited for here, under the deadline (a
          // blocking copy would wait for it in the driver, deaf to both).
          if (sync) {
            waitEvent(sync->ready, dl, "the device work queued before it on " + sync->device.str());
          }
          const int src = body(dl);
          work->markDone(outputs, src);
        } catch (...) {
          // Fail-stop: any error breaks the group, here and (through the
          // bridge) on every peer; the first failure is what all report.
          auto error = std::current_exception();
          if (!stop_.load()) {
            fail_.record(id, opName, errorText(error));
            if (bridge_) bridge_->poison(fail_.first());
          }
          work->markFailed(error);
        }
        if (impl) {
          impl->exchangeStream(*prevStream);
          impl->setDevice(*prevDevice);
        }
      },
      [work](std::exception_ptr e) { work->markFailed(e); }});
  return work;
}

at::Tensor KaitianBackend::scratchCopy(const at::Tensor& t) {
  if (!t.is_cpu()) {
    at::Tensor out = at::empty({t.numel()}, t.options());
    out.view(t.sizes()).copy_(t);
    return out;
  }
  // One reused buffer: no page faults per call, and a plain memcpy on this
  // thread instead of ATen's copy, whose OpenMP workers keep spinning after the
  // copy and steal the cores the peers' progress threads need.
  const int64_t nb = nbytes(t);
  if (!scratch_.defined() || scratch_.numel() < nb) scratch_ = at::empty({nb}, at::kByte);
  at::Tensor out = scratch_.narrow(0, 0, nb).view(t.scalar_type());
  if (t.is_contiguous()) {
    if (nb > 0) std::memcpy(out.data_ptr(), t.data_ptr(), nb);
  } else {
    out.view(t.sizes()).copy_(t);
  }
  return out;
}

bool KaitianBackend::groupUsesVendor(int group, at::ScalarType dtype,
                                     std::optional<RedOp::RedOpType> op) const {
  if (layout_.groupDevice[group] == "cpu" && layout_.flatIntra) return false;  // kaitian's shm path
  const Gaps& gaps = gaps_[group];
  if (std::find(gaps.dtypes.begin(), gaps.dtypes.end(), dtype) != gaps.dtypes.end()) return false;
  return !op || std::find(gaps.ops.begin(), gaps.ops.end(), *op) == gaps.ops.end();
}

void KaitianBackend::setStripeWeights(std::vector<int64_t> weights) {
  const int W = getSize();
  TORCH_CHECK_VALUE(weights.empty() || static_cast<int>(weights.size()) == W,
                    "kaitian set_stripe_weights: ", weights.size(), " weights for ", W,
                    " ranks; give one per rank (or none for even stripes)");
  constexpr int64_t kMaxWeight = int64_t{1} << 30;
  int64_t sum = 0;
  for (size_t r = 0; r < weights.size(); ++r) {
    TORCH_CHECK_VALUE(weights[r] >= 0 && weights[r] <= kMaxWeight, "kaitian set_stripe_weights: ",
                      "rank ", r, "'s weight ", weights[r], " is outside [0, ", kMaxWeight, "]");
    sum += weights[r];
  }
  TORCH_CHECK_VALUE(weights.empty() || sum > 0,
                    "kaitian set_stripe_weights: every weight is 0; some rank must reduce");
  std::lock_guard<std::mutex> lock(stripeMu_);
  stripeWeights_ = std::move(weights);
}

std::vector<int64_t> KaitianBackend::stripeWeights() const {
  std::lock_guard<std::mutex> lock(stripeMu_);
  return stripeWeights_;
}

void KaitianBackend::setAway(std::string why) {
  std::lock_guard<std::mutex> lock(awayMu_);
  awayWhy_ = std::move(why);
}

void KaitianBackend::watchPeer(int peer, const std::string& what) {
  TORCH_CHECK(peer >= 0 && peer < size_ && peer != rank_, "kaitian watch_peer: rank ", peer,
              " is not a peer of rank ", rank_, " in a group of ", size_);
  if (!bridge_) return;
  // Outside every op: a deadline that never comes, the group's fail-stop state.
  const auto dl = Deadline::after(std::chrono::hours(24 * 365), what, &stop_, &fail_);
  std::lock_guard<std::mutex> lock(shutdownMu_);  // the bridge stays open while we look (stop_ says if not)
  try {
    dl.check(what);
    const std::string gone = bridge_->whyGone(peer, dl, what);
    if (!gone.empty()) dl.breakGroup(gone);
  } catch (...) {
    if (fail_.broken()) bridge_->poison(fail_.first());  // the other peers learn it too
    throw;
  }
}

std::pair<int64_t, double> KaitianBackend::reduceRate() const {
  return {meter_.elements.load(), static_cast<double>(meter_.nanos.load()) / 1e9};
}

void KaitianBackend::reduceFlat(at::Tensor& flat, const RedOp& op, std::vector<Range> stripes,
                                bool gather, const Deadline& dl,
                                const std::vector<int64_t>& weights) {
  const auto dtype = flat.scalar_type();
  const int W = getSize(), me = getRank();
  const int G = static_cast<int>(layout_.groupNames.size());
  applyPremul(op, flat);
  const auto base = op.op_ == RedOp::PREMUL_SUM ? RedOp::SUM : op.op_;
  const auto vendorOp = base == RedOp::AVG ? RedOp::SUM : base;  // what a vendor is asked for
  // Source groups: a vendor group contributes one partial; otherwise every rank is one.
  std::vector<std::vector<int>> groups;
  std::vector<int> groupOf(W);
  std::map<int, int> index;
  for (int r = 0; r < W; ++r) {
    const int g = layout_.groupOf[r];
    const int key = groupUsesVendor(g, dtype, vendorOp) ? g : G + r;
    auto it = index.find(key);
    if (it == index.end()) {
      it = index.emplace(key, static_cast<int>(groups.size())).first;
      groups.emplace_back();
    }
    groups[it->second].push_back(r);
    groupOf[r] = it->second;
  }
  if (groups[groupOf[me]].size() > 1) {
    auto vendor = flat.is_cpu() ? intraCpu_ : intraDevice_;
    TORCH_CHECK(vendor, "kaitian ", dl.what, ": no intra-group backend for ", flat.device(),
                " tensors in group ", layout_.groupNames[layout_.groupOf[me]]);
    c10d::AllreduceOptions o;
    o.reduceOp = RedOp(vendorOp);
    o.timeout = dl.timeout;
    std::vector<at::Tensor> v{flat};
    runVendor(vendor, [&] { return vendor->allreduce(v, o); }, flat.device(), dl);
  }
  if (groups.size() == 1) {
    // One source holds all the data (world size 1, or one vendor group): the
    // reduction is complete where the data is; no host staging.
    if (base == RedOp::AVG && W > 1) {
      if (at::isFloatingType(dtype)) {
        flat.div_(static_cast<double>(W));
      } else {
        flat.div_(W, "trunc");
      }
    }
    return;
  }
  Reducer reducer{base, dtype, W, &meter_};
  const int64_t n = flat.numel();
  const int64_t segElems = std::max<int64_t>(1, layout_.segmentBytes / flat.element_size());
  // The bridge call of the segment at `begin` on `buf`; identical segmentation on every rank.
  auto segmentSpec = [&](at::Tensor buf, int64_t begin) {
    const Range seg{begin, begin + buf.numel()};
    std::vector<Range> st(W);
    for (int r = 0; r < W; ++r) {
      if (stripes.empty()) {
        st[r] = weights.empty() ? evenPart(seg.size(), W, r) : weightedPart(seg.size(), weights, r);
      } else {
        const Range x = stripes[r].intersect(seg);
        st[r] = x.size() > 0 ? Range{x.begin - begin, x.end - begin} : Range{0, 0};
      }
    }
    return ReduceSpec{buf, std::move(st), gather, groups, groupOf, reducer};
  };
  if (flat.is_cpu()) {
    for (int64_t b = 0; b < n; b += segElems) {
      auto spec = segmentSpec(flat.narrow(0, b, std::min(segElems, n - b)), b);
      bridge_->reduce(spec, dl);
    }
    return;
  }
  // Device tensor: segment k+1's copy to the host (on the op's stream) runs
  // while segment k is on the bridge; results go back on a second stream. Two
  // reused pinned buffers of at most one segment carry them. Only what this
  // rank's bridge call reads (its share of its group's partial, its stripe)
  // goes to the host, and only what it writes (its stripe, or every stripe
  // when gathering) comes back.
  const c10::Device dev = flat.device();
  c10::impl::VirtualGuardImpl impl(dev.type());
  const c10::Stream side = impl.getStream(dev);
  const c10::Stream h2d = impl.getStreamFromGlobalPool(dev);
  PinnedRing& ring = pinnedRing(dev, std::min(segElems, n) * flat.element_size());
  // Whatever happens below (errors included), the op's stream waits for the
  // copies back before its tensors are read, completed or released.
  struct JoinBack {
    PinnedRing& ring;
    const c10::Stream& from;
    const c10::Stream& to;
    ~JoinBack() {
      try {
        ring.back.record(from);
        ring.back.block(to);
      } catch (...) {
      }
    }
  } join{ring, h2d, side};
  auto lenOf = [&](int64_t k) { return std::min(segElems, n - k * segElems); };
  auto specOf = [&](int64_t k) {
    return segmentSpec(ring.slot(static_cast<int>(k % 2), lenOf(k), dtype), k * segElems);
  };
  // Copies `ranges` of a segment from `src` to `dst` (device or slot), non-blocking.
  auto copy = [&](const at::Tensor& dst, const at::Tensor& src, const std::vector<Range>& ranges,
                  std::atomic<int64_t>& counter) {
    for (const Range& r : ranges) {
      if (r.size() == 0) continue;
      dst.narrow(0, r.begin, r.size()).copy_(src.narrow(0, r.begin, r.size()), /*non_blocking=*/true);
      counter += r.size() * flat.element_size();
    }
  };
  auto copyIn = [&](int64_t k) {
    const int i = static_cast<int>(k % 2);
    ring.freed[i].block(side);  // the buffer's previous copy back (any earlier op) is done
    const auto spec = specOf(k);
    copy(spec.buf, flat.narrow(0, k * segElems, lenOf(k)),
         unionOf(publishRange(spec, me), spec.stripes[me]), stagedIn_);
    ring.landed[i].record(side);
  };
  const int64_t segs = (n + segElems - 1) / segElems;
  copyIn(0);
  for (int64_t k = 0; k < segs; ++k) {
    const int i = static_cast<int>(k % 2);
    if (k + 1 < segs) copyIn(k + 1);
    waitEvent(ring.landed[i], dl, "the device-to-host copy");
    auto spec = specOf(k);
    bridge_->reduce(spec, dl);
    impl.exchangeStream(h2d);
    copy(flat.narrow(0, k * segElems, lenOf(k)), spec.buf,
         {gather ? Range{0, lenOf(k)} : spec.stripes[me]}, stagedOut_);
    ring.freed[i].record(h2d);
    impl.exchangeStream(side);
  }
}

int KaitianBackend::meetEmpty(const Deadline& dl) {
  const int W = getSize();
  if (W > 1) {
    exchangeBytes(nullptr, 0, std::vector<int64_t>(W, 0), std::vector<int64_t>(W, 0),
                  std::vector<uint8_t*>(W, nullptr), std::vector<int64_t>(W, 0), dl);
  }
  return -1;
}

void KaitianBackend::breakOnLocalError(const char* op) {
  auto error = std::current_exception();
  // Not when the group is already broken or shut down: that is the error.
  if (!stop_.load() && !fail_.broken()) {
    OpId id;
    id.seq = collectiveSeq_.load() + 1;  // the number this call would have had
    if (fail_.record(id, op, errorText(error)) && bridge_) bridge_->poison(fail_.first());
  }
  std::rethrow_exception(error);
}

std::vector<at::Tensor> KaitianBackend::rootList(const char* op, const char* list,
                                                 const char* lists,
                                                 std::vector<std::vector<at::Tensor>>& given,
                                                 const at::Tensor& like, int root) const {
  const int W = getSize();
  TORCH_CHECK(root >= 0 && root < W, "kaitian ", op, ": root ", root,
              " is not a rank of this group");
  if (getRank() != root) {
    TORCH_CHECK(given.empty() || (given.size() == 1 && given[0].empty()),
                "kaitian ", op, ": only the root (rank ", root, ") may pass a ", list);
    return {};
  }
  checkOne((std::string(op) + " (" + lists + " on the root)").c_str(), given.size());
  TORCH_CHECK(static_cast<int>(given[0].size()) == W, "kaitian ", op, ": the root's ", list,
              " has ", given[0].size(), " tensors, expected one per rank (", W, ")");
  const std::string entry = std::string("a ") + list + " entry";
  for (const auto& t : given[0]) checkSameKind(op, like, t, like.numel(), entry.c_str());
  return given[0];
}

void KaitianBackend::exchangeBytes(const uint8_t* blob, int64_t blobLen,
                                   std::vector<int64_t> sendOff, std::vector<int64_t> sendLen,
                                   std::vector<uint8_t*> recvPtr, std::vector<int64_t> recvLen,
                                   const Deadline& dl) {
  const int W = getSize(), me = getRank();
  if (W == 1) {
    if (sendLen[0] > 0 && recvPtr[0] != blob + sendOff[0]) {
      std::memmove(recvPtr[0], blob + sendOff[0], sendLen[0]);
    }
    return;
  }
  for (int d = 0; d < W; ++d) {
    TORCH_CHECK(sendOff[d] >= 0 && sendLen[d] >= 0 && sendOff[d] + sendLen[d] <= blobLen,
                "kaitian ", dl.what, ": internal error: piece for rank ", d, " out of range");
  }
  TORCH_CHECK(sendLen[me] == recvLen[me], "kaitian ", dl.what, ": this rank sends ", sendLen[me],
              " bytes to itself but expects ", recvLen[me], "; check the tensor shapes");
  ExchangeSpec spec{blob, blobLen, std::move(sendOff), std::move(sendLen), std::move(recvPtr),
                    std::move(recvLen)};
  bridge_->exchange(spec, dl);
}

void KaitianBackend::checkExchangePlan(const std::vector<int64_t>& sendLen,
                                       const std::vector<int64_t>& recvLen, const Deadline& dl) {
  const int W = getSize();
  if (W <= 2 || bridge_->checksEveryPair()) return;  // a pair of ranks sees its own mismatch
  std::vector<int64_t> mine(sendLen);
  mine.insert(mine.end(), recvLen.begin(), recvLen.end());
  const int64_t nb = static_cast<int64_t>(mine.size() * sizeof(int64_t));
  std::vector<int64_t> plans(static_cast<size_t>(2 * W) * W);  // rank s: sends[W], then receives[W]
  std::vector<uint8_t*> rptr(W);
  for (int s = 0; s < W; ++s) rptr[s] = reinterpret_cast<uint8_t*>(plans.data() + 2 * W * s);
  exchangeBytes(reinterpret_cast<const uint8_t*>(mine.data()), nb, std::vector<int64_t>(W, 0),
                std::vector<int64_t>(W, nb), rptr, std::vector<int64_t>(W, nb), dl);
  for (int s = 0; s < W; ++s) {
    for (int d = 0; d < W; ++d) {
      const int64_t sent = plans[2 * W * s + d], expected = plans[2 * W * d + W + s];
      if (sent != expected) dl.breakGroup(sizeMismatchText(dl.id, s, d, sent, expected));
    }
  }
}

// ---------------------------------------------------------------- reductions

c10::intrusive_ptr<c10d::Work> KaitianBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                         const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && tensors[0].is_sparse()) return allreduceSparse(tensors[0], opts);
  return collective("allreduce", [&]() -> Call {
    checkOne("allreduce", tensors.size());
    at::Tensor t = tensors[0];
    TORCH_CHECK(t.layout() == at::kStrided, "kaitian allreduce: layout ", t.layout(),
                " is not supported; use a dense (strided) or sparse COO tensor");
    checkReduceSupported("allreduce", opts.reduceOp.op_, t.scalar_type());
    const RedOp op = opts.reduceOp;
    auto weights = stripeWeights();
    OpId id = opId(OpType::ALLREDUCE, t, -1, op);
    id.stripes = stripeDigest(weights);
    return {OpType::ALLREDUCE, id,
            tensors, tensors, opts.timeout, [this, t, op, weights](const Deadline& dl) mutable {
              if (t.numel() == 0) return meetEmpty(dl);
              at::Tensor flat = t.is_contiguous() ? t.view({-1}) : t.contiguous().view({-1});
              reduceFlat(flat, op, {}, true, dl, weights);
              if (!t.is_contiguous()) t.copy_(flat.view(t.sizes()));
              return -1;
            }};
  });
}

c10::intrusive_ptr<c10d::Work> KaitianBackend::allreduceSparse(
    at::Tensor t, const c10d::AllreduceOptions& opts) {
  return collective("allreduce", [&]() -> Call {
    TORCH_CHECK(opts.reduceOp.op_ == RedOp::SUM, "kaitian allreduce: sparse tensors support only "
                "ReduceOp.SUM (got ", reduceOpName(opts.reduceOp.op_), "); densify with .to_dense()");
    std::vector<at::Tensor> tensors{t};
    return {OpType::ALLREDUCE, opId(OpType::_ALLREDUCE_SPARSE, t, -1, opts.reduceOp), tensors,
            tensors, opts.timeout, [this, t](const Deadline& dl) mutable {
              // Every rank gathers every rank's (indices, values); the sum is
              // the coalesced concatenation, identical everywhere.
              const int W = getSize();
              at::Tensor c = t.coalesce();
              at::Tensor idx = hostCopyOf(c._indices());
              at::Tensor val = hostCopyOf(c._values());
              const int64_t sparseDim = idx.size(0);
              int64_t nnz = val.size(0);
              std::vector<int64_t> counts(W, 0);
              std::vector<uint8_t*> rptr(W);
              for (int s = 0; s < W; ++s) rptr[s] = reinterpret_cast<uint8_t*>(&counts[s]);
              exchangeBytes(reinterpret_cast<uint8_t*>(&nnz), 8, std::vector<int64_t>(W, 0),
                            std::vector<int64_t>(W, 8), rptr, std::vector<int64_t>(W, 8), dl);
              std::vector<at::Tensor> idxs, vals;
              std::vector<int64_t> ilen(W), vlen(W);
              for (int s = 0; s < W; ++s) {
                idxs.push_back(at::empty({sparseDim, counts[s]}, idx.options()));
                auto shape = val.sizes().vec();
                shape[0] = counts[s];
                vals.push_back(at::empty(shape, val.options()));
                ilen[s] = nbytes(idxs[s]);
                vlen[s] = nbytes(vals[s]);
              }
              for (int s = 0; s < W; ++s) rptr[s] = bytesOf(idxs[s]);
              exchangeBytes(bytesOf(idx), nbytes(idx), std::vector<int64_t>(W, 0),
                            std::vector<int64_t>(W, nbytes(idx)), rptr, ilen, dl);
              for (int s = 0; s < W; ++s) rptr[s] = bytesOf(vals[s]);
              exchangeBytes(bytesOf(val), nbytes(val), std::vector<int64_t>(W, 0),
                            std::vector<int64_t>(W, nbytes(val)), rptr, vlen, dl);
              at::Tensor sum = at::sparse_coo_tensor(at::cat(idxs, 1), at::cat(vals, 0),
                                                     t.sizes(), val.options().layout(at::kSparse))
                                   .coalesce();
              t.copy_(sum.to(t.device()));
              return -1;
            }};
  });
}

c10::intrusive_ptr<c10d::Work> KaitianBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  return collective("allreduce_coalesced", [&]() -> Call {
    TORCH_CHECK(!tensors.empty(), "kaitian allreduce_coalesced: no tensors given");
    for (const auto& t : tensors) {
      TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type() && t.device() == tensors[0].device(),
                  "kaitian allreduce_coalesced: all tensors must share one dtype and device (got ",
                  t.scalar_type(), " on ", t.device(), " and ", tensors[0].scalar_type(), " on ",
                  tensors[0].device(), "); issue one call per dtype");
      checkReduceSupported("allreduce_coalesced", opts.reduceOp.op_, t.scalar_type());
    }
    const RedOp op = opts.reduceOp;
    auto ts = tensors;
    auto weights = stripeWeights();
    OpId id = opId(OpType::ALLREDUCE_COALESCED, tensors, -1, op);
    id.stripes = stripeDigest(weights);
    return {OpType::ALLREDUCE_COALESCED, id, tensors,
            tensors, opts.timeout, [this, ts, op, weights](const Deadline& dl) mutable {
              std::vector<at::Tensor> flats;
              for (auto& t : ts) flats.push_back(t.reshape({-1}));
              at::Tensor flat = at::cat(flats);
              if (flat.numel() == 0) return meetEmpty(dl);
              reduceFlat(flat, op, {}, true, dl, weights);
              int64_t off = 0;
              for (auto& t : ts) {
                t.copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
                off += t.numel();
              }
              return -1;
            }};
  });
}

c10::intrusive_ptr<c10d::Work> KaitianBackend::reduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::ReduceOptions& opts) {
  return collective("reduce", [&]() -> Call {
    checkOne("reduce", tensors.size());
    at::Tensor t = tensors[0];
    checkReduceSupported("reduce", opts.reduceOp.op_, t.scalar_type());
    const int root = static_cast<int>(opts.rootRank);
    TORCH_CHECK(root >= 0 && root < getSize(), "kaitian reduce: root ", root,
                " is not a rank of this group of ", getSize());
    const RedOp op = opts.reduceOp;
    return {OpType::REDUCE, opId(OpType::REDUCE, t, root, op),
            tensors, tensors, opts.timeout,
            [this, t, op, root](const Deadline& dl) mutable {
              if (t.numel() == 0) return meetEmpty(dl);
              if (auto vendor = soleVendor({t}, op.op_)) {
                std::vector<at::Tensor> v{t};
                c10d::ReduceOptions o;
                o.reduceOp = op;
                o.rootRank = root;
                o.timeout = dl.timeout;
                runVendor(vendor, [&] { return vendor->reduce(v, o); }, t.device(), dl);
                return -1;
              }
              const bool isRoot = getRank() == root;
              // Non-roots keep their input: reduce a copy.
              at::Tensor flat = (isRoot && t.is_contiguous()) ? t.view({-1})
                                                              : scratchCopy(t);
              std::vector<Range> stripes(getSize());
              stripes[root] = Range{0, flat.numel()};
              reduceFlat(flat, op, stripes, false, dl);
              if (isRoot && flat.data_ptr() != t.data_ptr()) t.copy_(flat.view(t.sizes()));
              return -1;
            }};
  });
}

c10::intrusive_ptr<c10d::Work> KaitianBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return collective("reduce_scatter", [&]() -> Call {
    checkOne("reduce_scatter", outputs.size());
    checkOne("reduce_scatter", inputs.size());
    at::Tensor out = outputs[0];
    auto ins = inputs[0];
    TORCH_CHECK(static_cast<int>(ins.size()) == getSize(), "kaitian reduce_scatter: input list has ",
                ins.size(), " tensors, expected one per rank (", getSize(), ")");
    for (const auto& t : ins) checkSameKind("reduce_scatter", out, t, out.numel(), "an input");
    checkReduceSupported("reduce_scatter", opts.reduceOp.op_, out.scalar_type());
    const RedOp op = opts.reduceOp;
    std::vector<at::Tensor> all = ins;
    all.push_back(out);
    return {OpType::REDUCE_SCATTER, opId(OpType::REDUCE_SCATTER, out, -1, op), outputs, all,
            opts.timeout, [this, out, ins, op](const Deadline& dl) mutable {
              const int64_t m = out.numel();
              if (m == 0) return meetEmpty(dl);
              std::vector<at::Tensor> flats;
              for (auto& t : ins) flats.push_back(t.reshape({-1}));
              at::Tensor flat = at::cat(flats);
              std::vector<Range> stripes(getSize());
              for (int r = 0; r < getSize(); ++r) stripes[r] = Range{r * m, (r + 1) * m};
              reduceFlat(flat, op, stripes, false, dl);
              out.copy_(flat.narrow(0, getRank() * m, m).view(out.sizes()));
              return -1;
            }};
  });
}

c10::intrusive_ptr<c10d::Work> KaitianBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  return collective("reduce_scatter_tensor", [&]() -> Call {
    at::Tensor out = output, in = input;
    TORCH_CHECK(in.scalar_type() == out.scalar_type(), "kaitian reduce_scatter_tensor: input dtype ",
                in.scalar_type(), " differs from output dtype ", out.scalar_type());
    TORCH_CHECK(in.numel() == out.numel() * getSize(), "kaitian reduce_scatter_tensor: input has ",
                in.numel(), " elements, expected world size (", getSize(), ") x output (",
                out.numel(), ")");
    checkReduceSupported("reduce_scatter_tensor", opts.reduceOp.op_, out.scalar_type());
    const RedOp op = opts.reduceOp;
    return {OpType::_REDUCE_SCATTER_BASE, opId(OpType::_REDUCE_SCATTER_BASE, out, -1, op), {out},
            {in, out}, opts.timeout, [this, out, in, op](const Deadline& dl) mutable {
              const int64_t m = out.numel();
              if (m == 0) return meetEmpty(dl);
              if (auto vendor = soleVendor({in, out}, op.op_)) {
                c10d::ReduceScatterOptions o;
                o.reduceOp = op;
                o.timeout = dl.timeout;
                runVendor(
                    vendor, [&] { return vendor->_reduce_scatter_base(out, in, o); }, out.device(), dl);
                return -1;
              }
              at::Tensor flat = scratchCopy(in);
              std::vector<Range> stripes(getSize());
              for (int r = 0; r < getSize(); ++r) stripes[r] = Range{r * m, (r + 1) * m};
              reduceFlat(flat, op, stripes, false, dl);
              out.copy_(flat.narrow(0, getRank() * m, m).view(out.sizes()));
              return -1;
            }};
  });
}

c10::intrusive_ptr<c10d::Work> KaitianBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return collective("reduce_scatter_tensor_coalesced", [&]() -> Call {
    TORCH_CHECK(outputs.size() == inputs.size(), "kaitian reduce_scatter_tensor_coalesced: ",
                outputs.size(), " outputs but ", inputs.size(), " inputs");
    for (size_t i = 0; i < outputs.size(); ++i) {
      TORCH_CHECK(inputs[i].numel() == outputs[i].numel() * getSize() &&
                      inputs[i].scalar_type() == outputs[i].scalar_type(),
                  "kaitian reduce_scatter_tensor_coalesced: input ", i,
                  " must have world size x the output's elements and the same dtype");
      checkReduceSupported("reduce_scatter_tensor_coalesced", opts.reduceOp.op_,
                           outputs[i].scalar_type());
    }
    const RedOp op = opts.reduceOp;
    auto outs = outputs, ins = inputs;
    std::vector<at::Tensor> all = ins;
    all.insert(all.end(), outs.begin(), outs.end());
    return {compat::kReduceScatterTensorCoalesced,
            opId(compat::kReduceScatterTensorCoalesced, outs, -1, op), outputs, all, opts.timeout,
            [this, outs, ins, op](const Deadline& dl) mutable {
              int64_t total = 0;
              for (const auto& o : outs) total += o.numel();
              if (total == 0) return meetEmpty(dl);
              for (size_t i = 0; i < outs.size(); ++i) {
                const int64_t m = outs[i].numel();
                if (m == 0) continue;
                at::Tensor flat = scratchCopy(ins[i]);
                std::vector<Range> stripes(getSize());
                for (int r = 0; r < getSize(); ++r) stripes[r] = Range{r * m, (r + 1) * m};
                reduceFlat(flat, op, stripes, false, dl);
                outs[i].copy_(flat.narrow(0, getRank() * m, m).view(outs[i].sizes()));
              }
              return -1;
            }};
  });
}

// ------------------------------------------------------------- data movement

c10::intrusive_ptr<c10d::Work> KaitianBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                         const c10d::BroadcastOptions& opts) {
  return collective("broadcast", [&]() -> Call {
    checkOne("broadcast", tensors.size());
    const int root = static_cast<int>(opts.rootRank);
    TORCH_CHECK(root >= 0 && root < getSize(), "kaitian broadcast: root ", root,
                " is not a rank of this group of ", getSize());
    at::Tensor t = tensors[0];
    TORCH_CHECK(t.layout() == at::kStrided,
                "kaitian broadcast: sparse tensors are not supported; call .to_dense() first");
    return {OpType::BROADCAST, opId(OpType::BROADCAST, t, root),
            tensors, tensors, opts.timeout,
            [this, t, root](const Deadline& dl) mutable {
              if (getSize() == 1) return -1;
              if (auto vendor = soleVendor({t})) {
                std::vector<at::Tensor> v{t};
                c10d::BroadcastOptions o;
                o.rootRank = root;
                o.timeout = dl.timeout;
                runVendor(vendor, [&] { return vendor->broadcast(v, o); }, t.device(), dl);
                return -1;
              }
              const int W = getSize(), me = getRank();
              const int64_t nb = nbytes(t);
              std::vector<int64_t> off(W, 0), len(W, 0), rlen(W, 0);
              std::vector<uint8_t*> rptr(W, nullptr);
              if (me == root) {
                at::Tensor h = hostCopyOf(t);
                for (int d = 0; d < W; ++d) len[d] = d == me ? 0 : nb;
                exchangeBytes(bytesOf(h), nb, off, len, rptr, rlen, dl);
              } else {
                at::Tensor h = hostBufferFor(t);
                rptr[root] = bytesOf(h);
                rlen[root] = nb;
                exchangeBytes(nullptr, 0, off, len, rptr, rlen, dl);
                writeBack(t, h);
              }
              return -1;
            }};
  });
}

namespace {
// Shared body of allgather-like ops: every rank sends `in` to every rank; the
// piece from rank s lands in outs[s].
struct GatherPlan {
  std::vector<at::Tensor> targets;  // user tensors to write back (may be empty)
  std::vector<at::Tensor> buffers;  // host buffers, one per source
};
}  // namespace

c10::intrusive_ptr<c10d::Work> KaitianBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return collective("allgather", [&]() -> Call {
    checkOne("allgather", inputs.size());
    checkOne("allgather", outputs.size());
    at::Tensor in = inputs[0];
    auto outs = outputs[0];
    TORCH_CHECK(static_cast<int>(outs.size()) == getSize(), "kaitian allgather: output list has ",
                outs.size(), " tensors, expected one per rank (", getSize(), ")");
    for (const auto& o : outs) checkSameKind("allgather", in, o, in.numel(), "an output");
    std::vector<at::Tensor> all = outs;
    all.push_back(in);
    return {OpType::ALLGATHER, opId(OpType::ALLGATHER, in),
            outs, all, opts.timeout,
            [this, in, outs](const Deadline& dl) mutable {
              if (getSize() == 1) {  // where the data is: no host staging
                outs[0].copy_(in.reshape(outs[0].sizes()));
                return -1;
              }
              std::vector<at::Tensor> all = outs;
              all.push_back(in);
              if (auto vendor = soleVendor(all)) {
                std::vector<std::vector<at::Tensor>> o{outs};
                std::vector<at::Tensor> i{in};
                c10d::AllgatherOptions opts;
                opts.timeout = dl.timeout;
                runVendor(
                    vendor, [&] { return vendor->allgather(o, i, opts); }, in.device(), dl);
                return -1;
              }
              const int W = getSize();
              const int64_t nb = nbytes(in);
              at::Tensor h = hostCopyOf(in);
              std::vector<at::Tensor> bufs;
              std::vector<uint8_t*> rptr(W);
              for (int s = 0; s < W; ++s) {
                bufs.push_back(hostBufferFor(outs[s]));
                rptr[s] = bytesOf(bufs[s]);
              }
              exchangeBytes(bytesOf(h), nb, std::vector<int64_t>(W, 0),
                            std::vector<int64_t>(W, nb), rptr, std::vector<int64_t>(W, nb),
                            dl);
              for (int s = 0; s < W; ++s) writeBack(outs[s], bufs[s]);
              return -1;
            }};
  });
}

c10::intrusive_ptr<c10d::Work> KaitianBackend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  return collective("allgather_into_tensor", [&]() -> Call {
    at::Tensor out = output, in = input;
    TORCH_CHECK(in.scalar_type() == out.scalar_type(), "kaitian allgather_into_tensor: input dtype ",
                in.scalar_type(), " differs from output dtype ", out.scalar_type());
    TORCH_CHECK(out.numel() == in.numel() * getSize(), "kaitian allgather_into_tensor: output has ",
                out.numel(), " elements, expected world size (", getSize(), ") x input (",
                in.numel(), ")");
    return {OpType::_ALLGATHER_BASE, opId(OpType::_ALLGATHER_BASE, in), {out},
            {in, out}, opts.timeout, [this, in, out](const Deadline& dl) mutable {
              if (getSize() == 1) {  // where the data is: no host staging
                out.copy_(in.reshape(out.sizes()));
                return -1;
              }
              if (auto vendor = soleVendor({in, out})) {
                c10d::AllgatherOptions opts;
                opts.timeout = dl.timeout;
                runVendor(
                    vendor, [&] { return vendor->_allgather_base(out, in, opts); }, in.device(), dl);
                return -1;
              }
              const int W = getSize();
              const int64_t nb = nbytes(in);
              at::Tensor h = hostCopyOf(in);
              at::Tensor ob = hostBufferFor(out);
              std::vector<uint8_t*> rptr(W);
              for (int s = 0; s < W; ++s) rptr[s] = bytesOf(ob) + s * nb;
              exchangeBytes(bytesOf(h), nb, std::vector<int64_t>(W, 0),
                            std::vector<int64_t>(W, nb), rptr, std::vector<int64_t>(W, nb),
                            dl);
              writeBack(out, ob);
              return -1;
            }};
  });
}

c10::intrusive_ptr<c10d::Work> KaitianBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return collective("allgather_coalesced", [&]() -> Call {
    const int W = getSize();
    TORCH_CHECK(outputs.size() == static_cast<size_t>(W),
                "kaitian allgather_coalesced: expected one output list per rank (", W, "), got ",
                outputs.size());
    for (const auto& list : outputs) {
      TORCH_CHECK(list.size() == inputs.size(), "kaitian allgather_coalesced: each output list must "
                  "have as many tensors as the input list (", inputs.size(), ")");
      for (size_t i = 0; i < list.size(); ++i) {
        checkSameKind("allgather_coalesced", inputs[i], list[i], inputs[i].numel(), "an output");
      }
    }
    auto ins = inputs;
    auto outs = outputs;
    std::vector<at::Tensor> flatOuts, all = inputs;
    for (auto& l : outputs) {
      flatOuts.insert(flatOuts.end(), l.begin(), l.end());
    }
    all.insert(all.end(), flatOuts.begin(), flatOuts.end());
    return {OpType::ALLGATHER_COALESCED, opId(OpType::ALLGATHER_COALESCED, ins), flatOuts, all,
            opts.timeout, [this, ins, outs](const Deadline& dl) mutable {
              const int W = getSize();
              // One exchange: the inputs concatenated as bytes.
              std::vector<at::Tensor> hs;
              for (auto& t : ins) hs.push_back(hostCopyOf(t).reshape({-1}).view(at::kByte));
              at::Tensor blob = hs.empty() ? at::empty({0}, at::kByte) : at::cat(hs);
              const int64_t nb = blob.numel();
              at::Tensor recv = at::empty({W, nb}, at::kByte);
              std::vector<uint8_t*> rptr(W);
              for (int s = 0; s < W; ++s) rptr[s] = bytesOf(recv) + s * nb;
              exchangeBytes(bytesOf(blob), nb, std::vector<int64_t>(W, 0),
                            std::vector<int64_t>(W, nb), rptr, std::vector<int64_t>(W, nb),
                            dl);
              for (int s = 0; s < W; ++s) {
                int64_t off = 0;
                for (size_t i = 0; i < ins.size(); ++i) {
                  const int64_t b = nbytes(ins[i]);
                  at::Tensor piece = recv[s].narrow(0, off, b).view(ins[i].scalar_type());
                  outs[s][i].copy_(piece.view(outs[s][i].sizes()));
                  off += b;
                }
              }
              return -1;
            }};
  });
}

c10::intrusive_ptr<c10d::Work> KaitianBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return collective("allgather_into_tensor_coalesced", [&]() -> Call {
    TORCH_CHECK(outputs.size() == inputs.size(), "kaitian allgather_into_tensor_coalesced: ",
                outputs.size(), " outputs but ", inputs.size(), " inputs");
    for (size_t i = 0; i < inputs.size(); ++i) {
      TORCH_CHECK(outputs[i].numel() == inputs[i].numel() * getSize() &&
                      outputs[i].scalar_type() == inputs[i].scalar_type(),
                  "kaitian allgather_into_tensor_coalesced: output ", i,
                  " must have world size x the input's elements and the same dtype");
    }
    auto ins = inputs, outs = outputs;
    std::vector<at::Tensor> all = ins;
    all.insert(all.end(), outs.begin(), outs.end());
    return {compat::kAllgatherIntoTensorCoalesced,
            opId(compat::kAllgatherIntoTensorCoalesced, ins), outputs, all, opts.timeout,
            [this, ins, outs](const Deadline& dl) mutable {
              const int W = getSize();
              for (size_t i = 0; i < ins.size(); ++i) {
                const int64_t nb = nbytes(ins[i]);
                at::Tensor h = hostCopyOf(ins[i]);
                at::Tensor ob = hostBufferFor(outs[i]);
                std::vector<uint8_t*> rptr(W);
                for (int s = 0; s < W; ++s) rptr[s] = bytesOf(ob) + s * nb;
                exchangeBytes(bytesOf(h), nb, std::vector<int64_t>(W, 0),
                              std::vector<int64_t>(W, nb), rptr,
                              std::vector<int64_t>(W, nb), dl);
                writeBack(outs[i], ob);
              }
              return -1;
            }};
  });
}

c10::intrusive_ptr<c10d::Work> KaitianBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  return collective("gather", [&]() -> Call {
    checkOne("gather", inputs.size());
    const int root = static_cast<int>(opts.rootRank);
    at::Tensor in = inputs[0];
    std::vector<at::Tensor> outs =
        rootList("gather", "gather_list", "output lists", outputs, in, root);
    std::vector<at::Tensor> all = outs;
    all.push_back(in);
    return {OpType::GATHER, opId(OpType::GATHER, in, root), outs, all,
            opts.timeout,
            [this, in, outs, root](const Deadline& dl) mutable {
              const int W = getSize(), me = getRank();
              const int64_t nb = nbytes(in);
              at::Tensor h = hostCopyOf(in);
              std::vector<int64_t> len(W, 0), rlen(W, 0);
              std::vector<uint8_t*> rptr(W, nullptr);
              std::vector<at::Tensor> bufs;
              len[root] = nb;
              if (me == root) {
                for (int s = 0; s < W; ++s) {
                  bufs.push_back(hostBufferFor(outs[s]));
                  rptr[s] = bytesOf(bufs[s]);
                  rlen[s] = nb;
                }
              }
              exchangeBytes(bytesOf(h), nb, std::vector<int64_t>(W, 0), len, rptr, rlen, dl);
              if (me == root) {
                for (int s = 0; s < W; ++s) writeBack(outs[s], bufs[s]);
              }
              return -1;
            }};
  });
}

c10::intrusive_ptr<c10d::Work> KaitianBackend::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  return collective("scatter", [&]() -> Call {
    checkOne("scatter", outputs.size());
    const int root = static_cast<int>(opts.rootRank);
    at::Tensor out = outputs[0];
    std::vector<at::Tensor> ins =
        rootList("scatter", "scatter_list", "input lists", inputs, out, root);
    std::vector<at::Tensor> all = ins;
    all.push_back(out);
    return {OpType::SCATTER, opId(OpType::SCATTER, out, root),
            outputs, all, opts.timeout,
            [this, out, ins, root](const Deadline& dl) mutable {
              const int W = getSize(), me = getRank();
              const int64_t nb = nbytes(out);
              at::Tensor ob = hostBufferFor(out);
              std::vector<int64_t> off(W, 0), len(W, 0), rlen(W, 0);
              std::vector<uint8_t*> rptr(W, nullptr);
              rptr[root] = bytesOf(ob);
              rlen[root] = nb;
              at::Tensor blob;
              if (me == root) {
                std::vector<at::Tensor> hs;
                for (auto& t : ins) hs.push_back(hostCopyOf(t).reshape({-1}));
                blob = at::cat(hs);
                for (int d = 0; d < W; ++d) {
                  off[d] = d * nb;
                  len[d] = nb;
                }
              }
              exchangeBytes(blob.defined() ? bytesOf(blob) : nullptr,
                            blob.defined() ? nbytes(blob) : 0, off, len, rptr, rlen, dl);
              writeBack(out, ob);
              return -1;
            }};
  });
}

c10::intrusive_ptr<c10d::Work> KaitianBackend::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes, const c10d::AllToAllOptions& opts) {
  return collective("alltoall_single", [&]() -> Call {
    const int W = getSize();
    at::Tensor out = output, in = input;
    TORCH_CHECK(in.scalar_type() == out.scalar_type(), "kaitian alltoall_single: input dtype ",
                in.scalar_type(), " differs from output dtype ", out.scalar_type());
    auto splits = [&](std::vector<int64_t> s, const at::Tensor& t, const char* which) {
      const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
      if (s.empty()) {
        TORCH_CHECK(rows % W == 0, "kaitian alltoall_single: ", which, " dim 0 (", rows,
                    ") is not divisible by the world size (", W, "); pass split sizes");
        return std::vector<int64_t>(W, rows / W);
      }
      TORCH_CHECK(static_cast<int>(s.size()) == W, "kaitian alltoall_single: ", which,
                  " split sizes has ", s.size(), " entries, expected ", W);
      for (size_t r = 0; r < s.size(); ++r) {
        TORCH_CHECK(s[r] >= 0, "kaitian alltoall_single: ", which, " split sizes[", r, "] is ",
                    s[r], "; split sizes must not be negative");
      }
      TORCH_CHECK(std::accumulate(s.begin(), s.end(), int64_t{0}) == rows,
                  "kaitian alltoall_single: ", which, " split sizes sum to ",
                  std::accumulate(s.begin(), s.end(), int64_t{0}), " but dim 0 is ", rows);
      return s;
    };
    auto inS = splits(inputSplitSizes, in, "input");
    auto outS = splits(outputSplitSizes, out, "output");
    const int64_t inRow = in.dim() == 0 || in.size(0) == 0 ? 0 : in.numel() / in.size(0);
    const int64_t outRow = out.dim() == 0 || out.size(0) == 0 ? 0 : out.numel() / out.size(0);
    TORCH_CHECK(inRow == outRow || inRow == 0 || outRow == 0,
                "kaitian alltoall_single: input rows have ", inRow, " elements, output rows ",
                outRow, "; use matching trailing dimensions");
    return {OpType::ALLTOALL_BASE, opId(OpType::ALLTOALL_BASE, in.scalar_type(), -1), {out},
            {in, out}, opts.timeout,
            [this, in, out, inS, outS, inRow, outRow](const Deadline& dl) mutable {
              const int W = getSize();
              const int64_t es = in.element_size();
              at::Tensor h = hostCopyOf(in);
              at::Tensor ob = hostBufferFor(out);
              std::vector<int64_t> off(W), len(W), rlen(W);
              std::vector<uint8_t*> rptr(W);
              int64_t so = 0, ro = 0;
              for (int r = 0; r < W; ++r) {
                off[r] = so * inRow * es;
                len[r] = inS[r] * inRow * es;
                so += inS[r];
                rptr[r] = bytesOf(ob) + ro * outRow * es;
                rlen[r] = outS[r] * outRow * es;
                ro += outS[r];
              }
              checkExchangePlan(len, rlen, dl);
              exchangeBytes(bytesOf(h), nbytes(h), off, len, rptr, rlen, dl);
              writeBack(out, ob);
              return -1;
            }};
  });
}

c10::intrusive_ptr<c10d::Work> KaitianBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const c10d::AllToAllOptions& opts) {
  return collective("alltoall", [&]() -> Call {
    const int W = getSize();
    TORCH_CHECK(static_cast<int>(outputs.size()) == W && static_cast<int>(inputs.size()) == W,
                "kaitian alltoall: expects one input and one output tensor per rank (", W,
                "), got ", inputs.size(), " inputs and ", outputs.size(), " outputs");
    for (int r = 0; r < W; ++r) {
      TORCH_CHECK(outputs[r].scalar_type() == inputs[0].scalar_type() &&
                      inputs[r].scalar_type() == inputs[0].scalar_type(),
                  "kaitian alltoall: all tensors must share one dtype");
    }
    auto ins = inputs, outs = outputs;
    std::vector<at::Tensor> all = ins;
    all.insert(all.end(), outs.begin(), outs.end());
    return {OpType::ALLTOALL, opId(OpType::ALLTOALL, inputs[0].scalar_type(), -1), outputs, all,
            opts.timeout, [this, ins, outs](const Deadline& dl) mutable {
              const int W = getSize();
              std::vector<at::Tensor> hs;
              for (auto& t : ins) hs.push_back(hostCopyOf(t).reshape({-1}));
              at::Tensor blob = at::cat(hs);
              std::vector<int64_t> off(W), len(W), rlen(W);
              std::vector<uint8_t*> rptr(W);
              std::vector<at::Tensor> bufs;
              int64_t o = 0;
              for (int r = 0; r < W; ++r) {
                off[r] = o;
                len[r] = nbytes(ins[r]);
                o += len[r];
                bufs.push_back(hostBufferFor(outs[r]));
                rptr[r] = bytesOf(bufs[r]);
                rlen[r] = nbytes(outs[r]);
              }
              checkExchangePlan(len, rlen, dl);
              exchangeBytes(bytesOf(blob), nbytes(blob), off, len, rptr, rlen, dl);
              for (int r = 0; r < W; ++r) writeBack(outs[r], bufs[r]);
              return -1;
            }};
  });
}

c10::intrusive_ptr<c10d::Work> KaitianBackend::barrier(const c10d::BarrierOptions& opts) {
  return collective("barrier", [&]() -> Call {
    // As NCCL's, a barrier orders the rank's device: it meets the peers once the
    // device work queued before it finished, so each rank's is done on return.
    return {OpType::BARRIER, opId(OpType::BARRIER), {}, {},
            opts.timeout,
            [this](const Deadline& dl) {
              const int W = getSize();
              exchangeBytes(nullptr, 0, std::vector<int64_t>(W, 0),
                            std::vector<int64_t>(W, 0), std::vector<uint8_t*>(W, nullptr),
                            std::vector<int64_t>(W, 0), dl);
              return -1;
            },
            layout_.device};
  });
}

// ------------------------------------------------------------ point to point

c10::intrusive_ptr<c10d::Work> KaitianBackend::send(std::vector<at::Tensor>& tensors, int dstRank,
                                                    int tag) {
  checkOne("send", tensors.size());
  TORCH_CHECK(dstRank >= 0 && dstRank < getSize(), "kaitian send: destination ", dstRank,
              " is not a rank of this group of ", getSize());
  at::Tensor t = tensors[0];
  return enqueue(*sends_, OpType::SEND, "send", opId(OpType::SEND, t, dstRank), tensors, tensors,
                 std::chrono::milliseconds(0),
                 [this, t, dstRank, tag](const Deadline& dl) {
                   at::Tensor h = hostCopyOf(t);
                   bridge_->send(dstRank, h.data_ptr(), nbytes(h), tag, dl);
                   return -1;
                 });
}

c10::intrusive_ptr<c10d::Work> KaitianBackend::recv(std::vector<at::Tensor>& tensors, int srcRank,
                                                    int tag) {
  checkOne("recv", tensors.size());
  TORCH_CHECK(srcRank >= 0 && srcRank < getSize(), "kaitian recv: source ", srcRank,
              " is not a rank of this group of ", getSize());
  at::Tensor t = tensors[0];
  return enqueue(*recvs_, OpType::RECV, "recv", opId(OpType::RECV, t, srcRank), tensors, tensors,
                 std::chrono::milliseconds(0),
                 [this, t, srcRank, tag](const Deadline& dl) mutable {
                   at::Tensor h = hostBufferFor(t);
                   const int src = bridge_->recv(srcRank, h.data_ptr(), nbytes(h), tag, dl);
                   writeBack(t, h);
                   return src;
                 });
}

c10::intrusive_ptr<c10d::Work> KaitianBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                             int tag) {
  checkOne("recv", tensors.size());
  at::Tensor t = tensors[0];
  return enqueue(*recvs_, OpType::RECVANYSOURCE, "recv", opId(OpType::RECVANYSOURCE, t),
                 tensors, tensors,
                 std::chrono::milliseconds(0), [this, t, tag](const Deadline& dl) mutable {
                   at::Tensor h = hostBufferFor(t);
                   const int src = bridge_->recv(-1, h.data_ptr(), nbytes(h), tag, dl);
                   writeBack(t, h);
                   return src;
                 });
}

}  // namespace kaitian
