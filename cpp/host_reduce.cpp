// Host reductions. Memory-bound: the float32/float64 SUM and AVG path is a plain
// loop the compiler vectorises and writes both destinations in one pass (no extra copy).
#include "host_reduce.hpp"

#include "compat.hpp"

#include <chrono>
#include <cstring>

namespace kaitian {

using Op = c10d::ReduceOp;

const char* reduceOpName(Op::RedOpType op) {
  switch (op) {
    case Op::SUM: return "SUM";
    case Op::AVG: return "AVG";
    case Op::PRODUCT: return "PRODUCT";
    case Op::MIN: return "MIN";
    case Op::MAX: return "MAX";
    case Op::BAND: return "BAND";
    case Op::BOR: return "BOR";
    case Op::BXOR: return "BXOR";
    case Op::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNKNOWN";
  }
}

void checkReduceSupported(const char* opName, Op::RedOpType op, at::ScalarType dtype) {
  const bool floating = dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
                        dtype == at::kBFloat16;
  const bool integral = dtype == at::kChar || dtype == at::kShort || dtype == at::kInt ||
                        dtype == at::kLong || dtype == at::kByte;
  const bool boolean = dtype == at::kBool;
  TORCH_CHECK(floating || integral || boolean, "kaitian ", opName, ": reducing dtype ", dtype,
              " is not supported (use float16/32/64, bfloat16, int8/16/32/64, uint8 or bool; "
              "for complex tensors reduce torch.view_as_real(t))");
  switch (op) {
    case Op::SUM: case Op::PRODUCT: case Op::MIN: case Op::MAX:
      return;
    case Op::AVG: case Op::PREMUL_SUM:
      TORCH_CHECK(!boolean, "kaitian ", opName, ": ReduceOp.", reduceOpName(op),
                  " is not defined for bool tensors; use MIN/MAX/BAND/BOR or convert to int");
      TORCH_CHECK(op != Op::PREMUL_SUM || floating, "kaitian ", opName,
                  ": PREMUL_SUM needs a floating-point tensor, got ", dtype);
      return;
    case Op::BAND: case Op::BOR: case Op::BXOR:
      TORCH_CHECK(!floating, "kaitian ", opName, ": bitwise ReduceOp.", reduceOpName(op),
                  " is not defined for ", dtype, "; use an integer or bool tensor");
      return;
    default:
      TORCH_CHECK(false, "kaitian ", opName, ": unsupported reduce op ", static_cast<int>(op));
  }
}

void applyPremul(const c10d::ReduceOp& op, at::Tensor& t) {
  if (op.op_ != Op::PREMUL_SUM) return;
  auto* sup = dynamic_cast<compat::PreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK(sup != nullptr, "kaitian: PREMUL_SUM without a factor; create it with "
                              "torch.distributed._make_nccl_premul_sum(factor)");
  if (sup->tensor_factor.defined()) {
    t.mul_(sup->tensor_factor.to(t.device()));
  } else {
    t.mul_(sup->double_factor);
  }
}

namespace {

// Sum, divided by `div` after summing when kAvg (the general path's order).
template <typename T, bool kAvg>
void sumLoop(const std::vector<const void*>& srcs, int64_t n, T* d0, T* d1, T div) {
  const T* a = static_cast<const T*>(srcs[0]);
  const T* __restrict b = static_cast<const T*>(srcs[1]);
  if (srcs.size() == 2 && d1 != nullptr) {
    T* __restrict o1 = d1;
    for (int64_t i = 0; i < n; ++i) {
      T v = a[i] + b[i];
      if constexpr (kAvg) v /= div;
      d0[i] = v;
      o1[i] = v;
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) d0[i] = a[i] + b[i];
  for (size_t k = 2; k < srcs.size(); ++k) {
    const T* __restrict s = static_cast<const T*>(srcs[k]);
    for (int64_t i = 0; i < n; ++i) d0[i] += s[i];
  }
  if constexpr (kAvg) {
    for (int64_t i = 0; i < n; ++i) d0[i] /= div;
  }
  if (d1 != nullptr) std::memcpy(d1, d0, n * sizeof(T));
}

template <typename T>
void fusedSum(const std::vector<const void*>& srcs, int64_t n, void* d0, void* d1,
              int64_t divisor) {
  auto* o0 = static_cast<T*>(d0);
  auto* o1 = static_cast<T*>(d1);
  if (divisor == 1) {
    sumLoop<T, false>(srcs, n, o0, o1, T(1));
  } else {
    sumLoop<T, true>(srcs, n, o0, o1, static_cast<T>(divisor));
  }
}

at::Tensor view(const void* p, int64_t n, at::ScalarType dtype) {
  return at::from_blob(const_cast<void*>(p), {n}, at::TensorOptions().dtype(dtype));
}

}  // namespace

void Reducer::operator()(const std::vector<const void*>& srcs, int64_t count, void* dst0,
                         void* dst1) const {
  if (count == 0) return;
  if (meter != nullptr) {
    const auto start = std::chrono::steady_clock::now();
    Reducer{op, dtype, divisor}(srcs, count, dst0, dst1);
    meter->nanos += std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now() - start).count();
    meter->elements += count;
    return;
  }
  const size_t esize = c10::elementSize(dtype);
  if (srcs.size() == 1) {
    // A single contribution: only AVG changes it.
    if (op != Op::AVG || divisor == 1) {
      if (dst0 != srcs[0]) std::memcpy(dst0, srcs[0], count * esize);
      if (dst1) std::memcpy(dst1, srcs[0], count * esize);
      return;
    }
  }
  // float32/float64 SUM and AVG (DDP's gradient mean) take the fused loop.
  const bool sumLike = op == Op::SUM || op == Op::PREMUL_SUM || op == Op::AVG;
  const int64_t div = op == Op::AVG ? divisor : 1;
  if (sumLike && srcs.size() >= 2 && dtype == at::kFloat) {
    fusedSum<float>(srcs, count, dst0, dst1, div);
    return;
  }
  if (sumLike && srcs.size() >= 2 && dtype == at::kDouble) {
    fusedSum<double>(srcs, count, dst0, dst1, div);
    return;
  }
  // General path: accumulate in a private tensor (float32 for half types so that
  // cross-group sums do not lose precision), then write the destinations.
  const bool half = dtype == at::kHalf || dtype == at::kBFloat16;
  at::Tensor acc = view(srcs[0], count, dtype).to(half ? at::kFloat : dtype, false, /*copy=*/true);
  for (size_t k = 1; k < srcs.size(); ++k) {
    at::Tensor s = view(srcs[k], count, dtype);
    if (half) s = s.to(at::kFloat);
    switch (op) {
      case Op::SUM: case Op::AVG: case Op::PREMUL_SUM: acc.add_(s); break;
      case Op::PRODUCT: acc.mul_(s); break;
      case Op::MIN: at::minimum_out(acc, acc, s); break;
      case Op::MAX: at::maximum_out(acc, acc, s); break;
      case Op::BAND: acc.bitwise_and_(s); break;
      case Op::BOR: acc.bitwise_or_(s); break;
      case Op::BXOR: acc.bitwise_xor_(s); break;
      default: TORCH_CHECK(false, "kaitian: unsupported reduce op ", static_cast<int>(op));
    }
  }
  if (op == Op::AVG && divisor != 1) {
    if (at::isFloatingType(acc.scalar_type())) {
      acc.div_(static_cast<double>(divisor));
    } else {
      acc.div_(divisor, "trunc");
    }
  }
  view(dst0, count, dtype).copy_(acc);
  if (dst1) view(dst1, count, dtype).copy_(acc);
}

}  // namespace kaitian
