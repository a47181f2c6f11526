// Async machinery: the Work handed to torch (backed by a Future) and the queues
// whose named threads execute ops in issue order.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

namespace kaitian {

class KaitianWork : public c10d::Work {
 public:
  KaitianWork(int rank, c10d::OpType opType, std::string opName, std::vector<c10::Device> devices);

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  // Blocks until the op completed, then makes the caller's current streams
  // wait for the op's device work.
  void synchronize() override;
  // True once the op's host side is done and its device work has finished.
  bool isCompleted() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override;
  int sourceRank() const override { return sourceRank_; }

  // Called on the executing thread exactly once, after the op's device work was
  // queued on that thread's current stream. wait() returns at once; the future
  // is completed (recording that stream) on a completion thread, so that its
  // callbacks may issue and wait for collectives.
  void markDone(std::vector<at::Tensor> outputs, int sourceRank = -1);
  void markFailed(std::exception_ptr error);
  const std::string& opName() const { return opName_; }

 private:
  std::vector<c10::Stream> opStreams() const;  // the executing thread's current streams
  bool completeUntakenFuture(const std::function<void()>& complete);
  std::string opName_;
  std::vector<c10::Device> devices_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::vector<at::Tensor> outputs_;
  int sourceRank_ = -1;
  std::optional<c10::Event> deviceDone_;  // recorded on the op's stream at markDone
  std::atomic<bool> done_{false};  // lets wait() spin briefly before sleeping
  bool futureTaken_ = false;  // getFuture() was called: callbacks may exist (under mutex_)
};

// Runs `job` (completing a future) on a completion thread, never on the caller's.
void completeFuture(std::function<void()> job);

// Runs a blocking call (joining a thread) without the Python GIL when the
// caller holds it: a future callback on our thread may need the GIL to finish.
// Set by the Python module; plain call when unset.
using BlockingHook = void (*)(const std::function<void()>&);
void setBlockingHook(BlockingHook hook);

// A FIFO of tasks run by one named thread. `stop()` fails what is still queued.
class OpQueue {
 public:
  struct Task {
    std::function<void()> run;                  // does the op and completes its Work
    std::function<void(std::exception_ptr)> fail;  // completes the Work with an error
  };
  explicit OpQueue(std::string threadName);
  ~OpQueue();
  void push(Task task);
  // Waits until every task queued so far has run (each op ends by its own deadline).
  void drain();
  void stop(const std::string& reason);

 private:
  // Shared with the thread, so that a thread detached in its own callback
  // (the owner destroyed from there) never touches freed memory.
  struct State {
    std::string name;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Task> tasks;
    std::atomic<size_t> queued{0};  // lets the idle thread spin briefly before sleeping
    bool stopping = false;
    bool running = false;  // a task is running (drain waits for it)
    std::condition_variable idle;  // notified after each task
  };
  static void loop(const std::shared_ptr<State>& state);
  std::shared_ptr<State> state_;
  std::thread thread_;
};

}  // namespace kaitian
