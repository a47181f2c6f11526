// Async machinery: the Work handed to torch (backed by a Future) and the queues
// whose named threads execute ops in issue order.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace kaitian {

class KaitianWork : public c10d::Work {
 public:
  KaitianWork(int rank, c10d::OpType opType, std::string opName, std::vector<c10::Device> devices);

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override;
  int sourceRank() const override { return sourceRank_; }

  // Called on the executing thread exactly once.
  void markDone(std::vector<at::Tensor> outputs, int sourceRank = -1);
  void markFailed(std::exception_ptr error);
  const std::string& opName() const { return opName_; }

 private:
  std::string opName_;
  std::vector<c10::Device> devices_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::vector<at::Tensor> outputs_;
  int sourceRank_ = -1;
  std::atomic<bool> done_{false};  // lets wait() spin briefly before sleeping
};

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
  };
  static void loop(const std::shared_ptr<State>& state);
  std::shared_ptr<State> state_;
  std::thread thread_;
};

}  // namespace kaitian
