// What the fake accelerator's runtime (runtime.cpp) offers its kernels (ops.cpp)
// and its cncl backend (cncl.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <functional>
#include <memory>

namespace pybind11 {
class module_;
}

namespace fake {
struct FStream;  // a FIFO run by its own worker thread
struct Mark {    // one recorded point on one stream
  FStream* s = nullptr;
  uint64_t seq = 0;
  std::shared_ptr<std::atomic<double>> time_ms;  // set when it runs, for timing events
};
constexpr auto kDev = c10::DeviceType::PrivateUse1;
FStream* current(c10::DeviceIndex d);
FStream* new_stream(c10::DeviceIndex d);   // a stream of its own
FStream* pool_stream(c10::DeviceIndex d);  // one of the device's pool, round robin
FStream* from_c10(const c10::Stream& s);
c10::Stream as_c10(FStream* s);
c10::Allocator* device_allocator();
void record_stream(const c10::DataPtr& p, FStream* s);
Mark record_mark(FStream* s, bool timing);
void block_on(const Mark& m, FStream* waiter);
bool passed(const Mark& m);    // the stream has run the marked task
void wait_for(const Mark& m);  // the host waits until it has
void init(int count);
bool with_python(const std::function<void()>& f);  // runs f unless Python has exited; whether it ran
void python_exits();  // from now on workers take no GIL (runtime.cpp, "Exit")
uint64_t enqueue(FStream* s, std::function<void()> fn);
void synchronize(FStream* s);  // raises the first error of a task queued on it
at::Tensor host_alias(const at::Tensor& t);  // a CPU tensor over a device tensor's bytes
void bind_cncl(pybind11::module_& m);        // the ProcessGroupCNCL class
}  // namespace fake
