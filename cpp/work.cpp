// Work completion and the op queues. Hand-off cost matters for small-message
// latency: a push is one mutex + condition-variable notify, no polling.
#include "work.hpp"

#include <pthread.h>
#include <sched.h>

#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

// OpenMP, if torch runs on it (weak: absent with other thread pools).
extern "C" void omp_set_num_threads(int) __attribute__((weak));

namespace kaitian {

namespace {
// Small ops finish in tens of microseconds; a brief yield-spin avoids paying a
// futex sleep + wake-up on each hand-off, and sched_yield keeps it polite on
// oversubscribed machines.
constexpr auto kSpin = std::chrono::microseconds(60);

template <typename Pred>
bool spinUntil(Pred ready) {
  const auto until = std::chrono::steady_clock::now() + kSpin;
  while (!ready()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    sched_yield();
  }
  return true;
}
}  // namespace

KaitianWork::KaitianWork(int rank, c10d::OpType opType, std::string opName,
                         std::vector<c10::Device> devices)
    : c10d::Work(rank, opType),
      opName_(std::move(opName)),
      devices_(std::move(devices)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                       devices_)) {}

bool KaitianWork::wait(std::chrono::milliseconds timeout) {
  spinUntil([&] { return done_.load(std::memory_order_acquire); });
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (timeout == kNoTimeout) {
      cv_.wait(lock, [&] { return completed_; });
    } else if (!cv_.wait_for(lock, timeout, [&] { return completed_; })) {
      C10_THROW_ERROR(DistBackendError,
                      "kaitian " + opName_ + ": Work.wait(timeout=" +
                          std::to_string(timeout.count()) +
                          " ms) expired before the op completed; it keeps running in the "
                          "background (wait again, or raise the timeout)");
    }
    if (exception_) std::rethrow_exception(exception_);
  }
  synchronize();
  return true;
}

void KaitianWork::synchronize() {
  // Host side done (wait() saw completed_); the caller's current streams wait
  // for the op's device work. The future is not involved: it completes later,
  // on a completion thread.
  {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return completed_; });
  }
  if (!deviceDone_) return;
  c10::impl::VirtualGuardImpl impl(devices_[0].type());
  for (const auto& device : devices_) deviceDone_->block(impl.getStream(device));
}

bool KaitianWork::isCompleted() {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ && (exception_ || !deviceDone_ || deviceDone_->query());
}

std::vector<at::Tensor> KaitianWork::result() {
  std::lock_guard<std::mutex> lock(mutex_);
  return outputs_;
}

void KaitianWork::markDone(std::vector<at::Tensor> outputs, int sourceRank) {
  if (!devices_.empty()) {
    c10::impl::VirtualGuardImpl impl(devices_[0].type());
    deviceDone_.emplace(devices_[0].type());
    deviceDone_->record(impl.getStream(devices_[0]));
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    outputs_ = outputs;
    sourceRank_ = sourceRank;
  }
  if (completeUntakenFuture([&] { future_->markCompleted(c10::IValue(outputs)); })) {
    finish();
    done_.store(true, std::memory_order_release);
    return;
  }
  finish();
  done_.store(true, std::memory_order_release);
  completeFuture([future = future_, outputs = std::move(outputs), streams = opStreams()]() mutable {
    // The future records its events on the current streams: the op's.
    c10::impl::VirtualGuardImpl impl(streams.empty() ? c10::DeviceType::CPU : streams[0].device_type());
    std::vector<c10::Stream> previous;
    for (const auto& s : streams) previous.push_back(impl.exchangeStream(s));
    future->markCompleted(c10::IValue(std::move(outputs)));
    for (const auto& s : previous) impl.exchangeStream(s);
  });
}

void KaitianWork::markFailed(std::exception_ptr error) {
  const bool completed = completeUntakenFuture([&] { future_->setErrorIfNeeded(error); });
  finish(error);
  done_.store(true, std::memory_order_release);
  if (!completed) completeFuture([future = future_, error] { future->setErrorIfNeeded(error); });
}

c10::intrusive_ptr<c10::ivalue::Future> KaitianWork::getFuture() {
  std::lock_guard<std::mutex> lock(mutex_);
  futureTaken_ = true;
  return future_;
}

bool KaitianWork::completeUntakenFuture(const std::function<void()>& complete) {
  // Nobody holds the future, so no callback can run here: complete it inline
  // (no hand-off on the Work.wait() latency path). Under mutex_, so that a
  // getFuture() racing with us returns it completed.
  std::lock_guard<std::mutex> lock(mutex_);
  if (futureTaken_) return false;
  complete();
  return true;
}

std::vector<c10::Stream> KaitianWork::opStreams() const {
  std::vector<c10::Stream> streams;
  if (devices_.empty()) return streams;
  c10::impl::VirtualGuardImpl impl(devices_[0].type());
  for (const auto& device : devices_) streams.push_back(impl.getStream(device));
  return streams;
}

namespace {
// Future callbacks (comm hooks, .then()) may issue collectives and wait for
// them, so they never run on a collectives thread, where they would wait
// behind themselves. An idle completion thread runs them; when every one is
// busy (a callback blocked on a nested future, whose completion is queued
// here too) another is started. Steady state: one thread, no thread starts.
// Never destroyed: detached threads may still wait on it at exit.
class CompletionPool {
 public:
  void submit(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(std::move(job));
      if (idle_ == 0) {
        std::thread([this] { loop(); }).detach();
        ++idle_;  // counted as idle until it takes its first job
      }
    }
    cv_.notify_one();
  }

 private:
  void loop() {
    pthread_setname_np(pthread_self(), "kt-callbacks");
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return !jobs_.empty(); });
      auto job = std::move(jobs_.front());
      jobs_.pop_front();
      --idle_;
      lock.unlock();
      job();  // completing a future never throws; its callbacks' errors go to their futures
      lock.lock();
      ++idle_;
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  size_t idle_ = 0;
};
}  // namespace

void completeFuture(std::function<void()> job) {
  static auto* pool = new CompletionPool();
  pool->submit(std::move(job));
}

namespace {
BlockingHook gBlockingHook = nullptr;
}  // namespace

void setBlockingHook(BlockingHook hook) { gBlockingHook = hook; }

OpQueue::OpQueue(std::string threadName) : state_(std::make_shared<State>()) {
  state_->name = std::move(threadName);
  thread_ = std::thread([state = state_] { loop(state); });
}

OpQueue::~OpQueue() { stop("process group destroyed"); }

void OpQueue::push(Task task) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    TORCH_CHECK(!state_->stopping, "kaitian: the process group was shut down; create a new one");
    state_->tasks.push_back(std::move(task));
    state_->queued.fetch_add(1, std::memory_order_release);
  }
  state_->cv.notify_one();
}

void OpQueue::drain() {
  if (thread_.get_id() == std::this_thread::get_id()) return;  // called from one of its own tasks
  auto wait = [this] {
    std::unique_lock<std::mutex> lock(state_->mu);
    state_->idle.wait(lock, [&] { return state_->stopping || (state_->tasks.empty() && !state_->running); });
  };
  if (gBlockingHook != nullptr) {
    gBlockingHook(wait);
  } else {
    wait();
  }
}

void OpQueue::stop(const std::string& reason) {
  std::deque<Task> left;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->stopping && !thread_.joinable()) return;
    state_->stopping = true;
  }
  state_->cv.notify_all();
  state_->idle.notify_all();
  if (thread_.joinable()) {
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();  // destroyed from one of our own callbacks
    } else if (gBlockingHook != nullptr) {
      gBlockingHook([this] { thread_.join(); });
    } else {
      thread_.join();
    }
  }
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    left.swap(state_->tasks);
  }
  for (auto& t : left) {
    try {
      C10_THROW_ERROR(DistBackendError, "kaitian: " + reason + " before the op ran");
    } catch (...) {
      t.fail(std::current_exception());
    }
  }
}

void OpQueue::loop(const std::shared_ptr<State>& state) {
  pthread_setname_np(pthread_self(), state->name.substr(0, 15).c_str());
  // ATen ops on this thread run single-threaded: OpenMP workers keep spinning
  // after a parallel region and would take the cores the peers need, and
  // communication is memory-bound anyway. (Thread-local; torch's own setting
  // is applied lazily first, so set ours after it.)
  at::internal::lazy_init_num_threads();
  if (omp_set_num_threads != nullptr) omp_set_num_threads(1);
  // Ops write into the user's tensors as gloo does, outside autograd: a leaf
  // Parameter that requires grad may be a collective's output.
  c10::AutoGradMode noGrad(false);
  while (true) {
    Task task;
    spinUntil([&] { return state->queued.load(std::memory_order_acquire) > 0; });
    {
      std::unique_lock<std::mutex> lock(state->mu);
      state->cv.wait(lock, [&] { return state->stopping || !state->tasks.empty(); });
      if (state->stopping) return;
      task = std::move(state->tasks.front());
      state->tasks.pop_front();
      state->queued.fetch_sub(1, std::memory_order_relaxed);
      state->running = true;
    }
    task.run();  // completes its own Work, errors included
    {
      std::lock_guard<std::mutex> lock(state->mu);
      state->running = false;
    }
    state->idle.notify_all();
  }
}

}  // namespace kaitian
