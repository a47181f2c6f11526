// Shared small types of the kaitian backend: deadlines, ranges, errors.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

namespace kaitian {

using Clock = std::chrono::steady_clock;

// A half-open element range [begin, end).
struct Range {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end > begin ? end - begin : 0; }
  Range intersect(const Range& o) const {
    Range r{std::max(begin, o.begin), std::min(end, o.end)};
    if (r.end < r.begin) r.end = r.begin;
    return r;
  }
};

// Part `i` of `n` of [0, total), sizes differing by at most one element.
inline Range evenPart(int64_t total, int64_t n, int64_t i) {
  const int64_t base = total / n, extra = total % n;
  const int64_t begin = i * base + std::min<int64_t>(i, extra);
  return Range{begin, begin + base + (i < extra ? 1 : 0)};
}

// When a blocking step must give up. Every wait in the bridges takes one.
struct Deadline {
  Clock::time_point at;
  std::string what;  // the op, for error messages ("allreduce")
  std::chrono::milliseconds timeout;
  const std::atomic<bool>* stop = nullptr;  // set when the backend shuts down

  static Deadline after(std::chrono::milliseconds t, std::string what,
                        const std::atomic<bool>* stop) {
    return Deadline{Clock::now() + t, std::move(what), t, stop};
  }
  bool expired() const { return Clock::now() >= at; }
  // Throws the error every waiting loop raises when it gives up.
  [[noreturn]] void fail(const std::string& waitingFor) const;
  // Throws if the deadline passed or the backend is shutting down.
  void check(const std::string& waitingFor) const {
    if (stop && stop->load(std::memory_order_relaxed)) {
      C10_THROW_ERROR(DistBackendError,
                      "kaitian " + what + ": process group was shut down while waiting for " +
                          waitingFor);
    }
    if (expired()) fail(waitingFor);
  }
};

inline void Deadline::fail(const std::string& waitingFor) const {
  C10_THROW_ERROR(
      DistBackendError,
      "kaitian " + what + ": timed out after " + std::to_string(timeout.count() / 1000.0) +
          " s waiting for " + waitingFor +
          " (a peer died, is stuck, or ranks issued different collectives; raise the "
          "process group timeout if the peer is only slow)");
}

}  // namespace kaitian
