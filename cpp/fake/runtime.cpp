// kaitian.testing._fake_accelerator: a PrivateUse1 device whose memory is host
// memory and whose streams are FIFOs run by worker threads, so that host code
// missing a stream wait, a record_stream or an event sees wrong data.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <thread>

#include "fake.hpp"

namespace fake {
using c10::DeviceIndex;
constexpr int kMaxDevices = 64;

static int g_count = 0;  // set once by init()

// --- streams -----------------------------------------------------------------

struct FStream {
  DeviceIndex device;
  int64_t id;
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  uint64_t enqueued = 0, completed = 0;
  std::string error;  // sticky: the first task that threw, raised at the next synchronize
  FStream(DeviceIndex d, int64_t i);
  uint64_t enqueue(std::function<void()> fn) {
    std::lock_guard<std::mutex> g(m);
    queue.push_back(std::move(fn));
    cv.notify_all();
    return ++enqueued;
  }
  uint64_t last() { std::lock_guard<std::mutex> g(m); return enqueued; }
  bool done(uint64_t seq) { std::lock_guard<std::mutex> g(m); return completed >= seq; }
  void wait(uint64_t seq) {
    // Without the GIL: a worker frees what its last task captured under the GIL
    // (see Exit) before it starts the next one, so a host thread that waited
    // holding it (a blocking copy, torch.load onto the device) would wait for
    // ever. A GPU needs no Python to progress; the fake must not either.
    std::optional<pybind11::gil_scoped_release> no_gil;
    if (Py_IsInitialized() && PyGILState_Check()) no_gil.emplace();
    std::unique_lock<std::mutex> l(m);
    cv.wait(l, [&] { return completed >= seq; });
  }
  void synchronize() {
    wait(last());
    std::lock_guard<std::mutex> g(m);
    if (!error.empty()) {
      auto e = error;
      error.clear();
      TORCH_CHECK(false, "fake accelerator: a task queued on stream ", id, " of device ", int(device),
                  " failed: ", e);
    }
  }
};

static std::mutex& g_streams_mutex = *new std::mutex();  // leaked, as the streams: workers outlive exit
static std::vector<std::vector<FStream*>>& g_streams = *new std::vector<std::vector<FStream*>>();  // [device][id]
// As CUDA's: a fixed pool of streams per device, handed out round robin, so
// that code taking a pool stream per op does not start a thread per op.
constexpr size_t kPoolStreams = 32;
static std::vector<std::vector<FStream*>>& g_pools = *new std::vector<std::vector<FStream*>>();  // [device]
static size_t g_pool_next[kMaxDevices] = {};
static thread_local int64_t t_current_stream[kMaxDevices] = {0};
static thread_local DeviceIndex t_current_device = 0;

// Exit. Once Python exits, a worker must not take the GIL: a finalizing
// interpreter answers with pthread_exit, which std::terminate()s the process
// inside a destructor. Releasing what a task captured can take it (torch drops
// a tensor's Python object under the GIL with its last C++ reference), as a
// Python task does. So from python_exits() (at atexit) workers keep what their
// tasks captured and skip Python tasks; the streams run on, as a GPU runs until
// the process ends. From the C++ exit on (static destruction, which reaches
// this library before torch) no task starts: torch is going away.
static std::shared_mutex& g_python = *new std::shared_mutex();  // held shared while a worker may take the GIL
static bool g_python_exited = false;                            // under g_python
static std::atomic<bool> g_process_exits{false};
static struct ProcessExit {
  ~ProcessExit() { g_process_exits = true; }
} g_process_exit;

bool with_python(const std::function<void()>& f) {
  std::shared_lock<std::shared_mutex> l(g_python);
  if (g_python_exited) return false;
  f();
  return true;
}
void python_exits() {  // called without the GIL: a worker holding g_python may be waiting for it
  std::unique_lock<std::shared_mutex> l(g_python);
  g_python_exited = true;
}

FStream::FStream(DeviceIndex d, int64_t i) : device(d), id(i) {
  std::thread([this] {
    t_current_device = device;
    t_current_stream[device] = id;  // work queued from a task (a future's event) lands here
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> l(m);
        cv.wait(l, [&] { return !queue.empty(); });
        if (g_process_exits) return;  // what is queued is abandoned, as a GPU's queue at exit
        fn = std::move(queue.front());
        queue.pop_front();
      }
      try {
        fn();
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> g(m);
        if (error.empty()) error = e.what();
      }
      {
        std::lock_guard<std::mutex> g(m);
        ++completed;
        cv.notify_all();
      }
      if (!with_python([&] { fn = nullptr; })) (new std::function<void()>())->swap(fn);  // kept (see Exit)
    }
  }).detach();
}

static void check_device(DeviceIndex d) {
  TORCH_CHECK(d >= 0 && d < g_count, "fake accelerator: device ", int(d), " does not exist (",
              g_count, " visible)");
}

FStream* stream(DeviceIndex d, int64_t id) {
  check_device(d);
  std::lock_guard<std::mutex> g(g_streams_mutex);
  auto& v = g_streams[d];
  TORCH_CHECK(id >= 0 && id < (int64_t)v.size(), "fake accelerator: no stream ", id, " on device ", int(d));
  return v[id];
}
static FStream* add_stream(DeviceIndex d) {  // under g_streams_mutex
  auto& v = g_streams[d];
  v.push_back(new FStream(d, (int64_t)v.size()));
  return v.back();
}
FStream* new_stream(DeviceIndex d) {
  check_device(d);
  std::lock_guard<std::mutex> g(g_streams_mutex);
  return add_stream(d);
}
FStream* pool_stream(DeviceIndex d) {
  check_device(d);
  std::lock_guard<std::mutex> g(g_streams_mutex);
  auto& pool = g_pools[d];
  const size_t k = g_pool_next[d]++ % kPoolStreams;
  if (k == pool.size()) pool.push_back(add_stream(d));
  return pool[k];
}
FStream* current(DeviceIndex d) { return stream(d, t_current_stream[d]); }
c10::Stream as_c10(FStream* s) { return c10::Stream(c10::Stream::UNSAFE, c10::Device(kDev, s->device), s->id); }
FStream* from_c10(const c10::Stream& s) { return stream(s.device_index(), s.id()); }

void init(int count) {
  std::lock_guard<std::mutex> g(g_streams_mutex);
  TORCH_CHECK(g_count == 0 || g_count == count, "fake accelerator: already installed with ", g_count,
              " devices, asked for ", count);
  TORCH_CHECK(count >= 0 && count <= kMaxDevices, "fake accelerator: 0 to ", kMaxDevices, " devices");
  if (g_count) return;
  g_streams.resize(count);
  g_pools.resize(count);
  for (int d = 0; d < count; ++d) g_streams[d].push_back(new FStream(d, 0));
  g_count = count;
}

// --- events ------------------------------------------------------------------

struct FEvent {
  bool timing = false;
  Mark mark;
};
static double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
Mark record_mark(FStream* s, bool timing) {
  Mark m;
  m.s = s;
  if (timing) {
    m.time_ms = std::make_shared<std::atomic<double>>(-1.0);
    auto t = m.time_ms;
    m.seq = s->enqueue([t] { t->store(now_ms()); });
  } else {
    m.seq = s->last();
  }
  return m;
}
void block_on(const Mark& m, FStream* waiter) {
  if (!m.s || m.s == waiter) return;
  auto src = m.s;
  auto seq = m.seq;
  waiter->enqueue([src, seq] { src->wait(seq); });
}

// --- allocators ----------------------------------------------------------------

struct Block {
  void* ptr;
  size_t size;
  DeviceIndex device;
  FStream* stream;            // allocated on; reused at once on it
  std::set<FStream*> uses;    // record_stream
  std::vector<Mark> pending;  // when freed: work that must end before reuse
};

struct DeviceAllocator final : c10::Allocator {
  std::mutex m;
  std::vector<Block*> free_blocks;
  static void del(void* ctx);
  c10::DataPtr allocate(size_t n) override {
    DeviceIndex d = t_current_device;
    check_device(d);
    FStream* s = current(d);
    size_t size = std::max<size_t>(512, (n + 511) / 512 * 512);
    Block* b = nullptr;
    {
      std::lock_guard<std::mutex> g(m);
      for (auto it = free_blocks.begin(); it != free_blocks.end(); ++it) {
        Block* c = *it;
        if (c->stream != s || c->size < size || c->size > 2 * size) continue;
        bool ready = true;
        for (auto& p : c->pending) ready = ready && p.s->done(p.seq);
        if (!ready) continue;
        b = c;
        free_blocks.erase(it);
        break;
      }
    }
    if (!b) {
      b = new Block{std::malloc(size), size, d, s, {}, {}};
      TORCH_CHECK(b->ptr, "fake accelerator: out of host memory for ", size, " bytes");
    }
    b->pending.clear();
    b->uses.clear();
    return c10::DataPtr(b->ptr, b, &DeviceAllocator::del, c10::Device(kDev, d));
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dst, const void* src, std::size_t n) const { std::memcpy(dst, src, n); }
  void record(const c10::DataPtr& p, FStream* s) {
    if (p.get_deleter() != &DeviceAllocator::del) return;
    auto b = static_cast<Block*>(p.get_context());
    std::lock_guard<std::mutex> g(m);
    if (s != b->stream) b->uses.insert(s);
  }
};
static DeviceAllocator& g_alloc = *new DeviceAllocator();  // leaked: tensors die after static destructors
void DeviceAllocator::del(void* ctx) {
  auto b = static_cast<Block*>(ctx);
  std::lock_guard<std::mutex> g(g_alloc.m);
  for (auto s : b->uses) b->pending.push_back(Mark{s, s->last(), nullptr});
  g_alloc.free_blocks.push_back(b);
}
c10::Allocator* device_allocator() { return &g_alloc; }
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_alloc);
void record_stream(const c10::DataPtr& p, FStream* s) { g_alloc.record(p, s); }

struct PinnedAllocator final : c10::Allocator {
  std::mutex m;
  std::map<uintptr_t, size_t> live;
  static void del(void* p) {
    {
      std::lock_guard<std::mutex> g(g_pinned().m);
      g_pinned().live.erase(reinterpret_cast<uintptr_t>(p));
    }
    std::free(p);
  }
  static PinnedAllocator& g_pinned();
  c10::DataPtr allocate(size_t n) override {
    void* p = std::malloc(std::max<size_t>(n, 1));
    TORCH_CHECK(p, "fake accelerator: out of pinned host memory");
    std::lock_guard<std::mutex> g(m);
    live[reinterpret_cast<uintptr_t>(p)] = n;
    return c10::DataPtr(p, p, &PinnedAllocator::del, c10::Device(c10::kCPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &PinnedAllocator::del; }
  void copy_data(void* dst, const void* src, std::size_t n) const { std::memcpy(dst, src, n); }
  bool contains(const void* p) {
    auto a = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> g(m);
    auto it = live.upper_bound(a);
    if (it == live.begin()) return false;
    --it;
    return a < it->first + std::max<size_t>(it->second, 1);
  }
};
PinnedAllocator& PinnedAllocator::g_pinned() {
  static PinnedAllocator* a = new PinnedAllocator();
  return *a;
}

// --- guard ---------------------------------------------------------------------

struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kDev; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kDev, t_current_device); }
  void setDevice(c10::Device d) const override {
    check_device(d.index());
    t_current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { t_current_device = d.index(); }
  c10::Stream getStream(c10::Device d) const override { return as_c10(current(d.index())); }
  c10::Stream getDefaultStream(c10::Device d) const override { return as_c10(stream(d.index(), 0)); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool = false) const override {
    return as_c10(pool_stream(d.index()));
  }
  c10::Stream getNewStream(c10::Device d, int = 0) const override { return as_c10(pool_stream(d.index())); }
  c10::Stream exchangeStream(c10::Stream s) const override {
    auto old = getStream(s.device());
    from_c10(s);
    t_current_stream[s.device_index()] = s.id();
    return old;
  }
  DeviceIndex deviceCount() const noexcept override { return static_cast<DeviceIndex>(g_count); }
  void record(void** event, const c10::Stream& s, const DeviceIndex index, const c10::EventFlag flag) const override {
    // as CUDA: an event belongs to the device of its first record
    TORCH_CHECK(index == -1 || index == s.device_index(), "fake accelerator: event device index ", int(index),
                " does not match recording stream's device index ", int(s.device_index()));
    if (!*event) *event = new FEvent{flag == c10::EventFlag::BACKEND_DEFAULT, {}};
    auto e = static_cast<FEvent*>(*event);
    e->mark = record_mark(from_c10(s), e->timing);
  }
  void block(void* event, const c10::Stream& s) const override {
    if (event) block_on(static_cast<FEvent*>(event)->mark, from_c10(s));
  }
  bool queryEvent(void* event) const override {
    auto e = static_cast<FEvent*>(event);
    return !e || !e->mark.s || e->mark.s->done(e->mark.seq);
  }
  void destroyEvent(void* event, const DeviceIndex) const noexcept override { delete static_cast<FEvent*>(event); }
  bool queryStream(const c10::Stream& s) const override {
    auto f = from_c10(s);
    return f->done(f->last());
  }
  void synchronizeStream(const c10::Stream& s) const override { from_c10(s)->synchronize(); }
  void synchronizeEvent(void* event) const {
    auto e = static_cast<FEvent*>(event);
    if (e && e->mark.s) e->mark.s->wait(e->mark.seq);
  }
  void synchronizeDevice(const DeviceIndex d) const {
    std::vector<FStream*> v;
    {
      std::lock_guard<std::mutex> g(g_streams_mutex);
      v = g_streams.at(d);
    }
    for (auto s : v) s->synchronize();
  }
  void recordDataPtrOnStream(const c10::DataPtr& p, const c10::Stream& s) const override {
    record_stream(p, from_c10(s));
  }
  double elapsedTime(void* a, void* b, const DeviceIndex) const {
    auto e1 = static_cast<FEvent*>(a), e2 = static_cast<FEvent*>(b);
    TORCH_CHECK(e1 && e2 && e1->mark.time_ms && e2->mark.time_ms,
                "fake accelerator: elapsed_time needs two events recorded with enable_timing=True");
    synchronizeEvent(a);
    synchronizeEvent(b);
    return e2->mark.time_ms->load() - e1->mark.time_ms->load();
  }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

// --- hooks: pinned memory ------------------------------------------------------

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const { return true; }
  bool isAvailable() const { return g_count > 0; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &PinnedAllocator::g_pinned(); }
  bool isPinnedPtr(const void* p) const override { return PinnedAllocator::g_pinned().contains(p); }
  const at::Generator& getDefaultGenerator(DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Device getDeviceFromPtr(void*) const override { return at::Device(kDev, t_current_device); }
  // Storage.resize_ (FSDP2 frees and refills its unsharded parameters so): a
  // fresh block, the old bytes copied once the current stream is done with them.
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    auto impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "fake accelerator: this storage is not resizable");
    const DeviceIndex d = impl->device().index();
    const DeviceIndex prev = t_current_device;
    t_current_device = d;
    c10::DataPtr fresh = g_alloc.allocate(newsize);
    t_current_device = prev;
    const size_t keep = std::min(newsize, impl->nbytes());
    if (keep > 0) {
      current(d)->synchronize();
      std::memcpy(fresh.get(), impl->data(), keep);
    }
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
};
static bool g_hooks = [] {
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return true;
}();

}  // namespace fake

namespace fake {
uint64_t enqueue(FStream* s, std::function<void()> fn) { return s->enqueue(std::move(fn)); }
void synchronize(FStream* s) {
  s->synchronize();
}
bool passed(const Mark& m) { return !m.s || m.s->done(m.seq); }
void wait_for(const Mark& m) {
  if (m.s) m.s->wait(m.seq);
}
}  // namespace fake
