// Host-side reduction kernels used by the bridges (ATen plus a fast float path).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <atomic>
#include <vector>

namespace kaitian {

// Elements this rank reduced on the host and the time it took: its reduce
// speed, which stripe weights may follow (kaitian.backend.stripes).
struct ReduceMeter {
  std::atomic<int64_t> elements{0};
  std::atomic<int64_t> nanos{0};
};

// How to combine contributions element-wise. AVG divides by `divisor` at the end;
// PREMUL_SUM is applied by the caller (inputs pre-multiplied), then it is a SUM.
struct Reducer {
  c10d::ReduceOp::RedOpType op = c10d::ReduceOp::SUM;
  at::ScalarType dtype = at::kFloat;
  int64_t divisor = 1;
  ReduceMeter* meter = nullptr;  // counts every call when set

  // dst0[i] = reduce(srcs[k][i] for k), also written to dst1 when not null.
  // srcs[0] may alias dst0 (the rank's own contribution); nothing else may.
  void operator()(const std::vector<const void*>& srcs, int64_t count, void* dst0,
                  void* dst1) const;
};

// Checks that `op` is defined for `dtype` and throws a message naming `opName`.
void checkReduceSupported(const char* opName, c10d::ReduceOp::RedOpType op,
                          at::ScalarType dtype);

// Name of a reduce op, for messages.
const char* reduceOpName(c10d::ReduceOp::RedOpType op);

// Scales `t` in place by the PREMUL_SUM factor of `op` (no-op for other ops).
void applyPremul(const c10d::ReduceOp& op, at::Tensor& t);

}  // namespace kaitian
