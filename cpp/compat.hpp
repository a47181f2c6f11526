// The c10d differences between the torch releases kaitian builds against
// (2.4 to 2.15), one name each, so the sources hold no version arithmetic.
// Each guard names the first release with the feature (read off the wheels'
// Backend.hpp / Work.hpp / Types.hpp of every minor release).
#pragma once

#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/version.h>

#define KAITIAN_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||          \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// Backend::shutdown() / abort() are virtual from 2.7 (torch calls them from
// destroy_process_group); before, kaitian's own shutdown runs from its destructor.
#if KAITIAN_TORCH_AT_LEAST(2, 7)
#define KAITIAN_BACKEND_SHUTDOWN_OVERRIDE override
#else
#define KAITIAN_BACKEND_SHUTDOWN_OVERRIDE
#endif

// Backend::setTimeout() is virtual from 2.9 (Python: Backend.set_timeout);
// before, the kaitian module binds set_timeout itself.
#if KAITIAN_TORCH_AT_LEAST(2, 9)
#define KAITIAN_BACKEND_HAS_SET_TIMEOUT 1
#define KAITIAN_BACKEND_SET_TIMEOUT_OVERRIDE override
#else
#define KAITIAN_BACKEND_HAS_SET_TIMEOUT 0
#define KAITIAN_BACKEND_SET_TIMEOUT_OVERRIDE
#endif

namespace kaitian {
namespace compat {

// The PREMUL_SUM factor: NCCLPreMulSumSupplement until 2.12, PreMulSumSupplement
// from 2.13 (which keeps the old name as an alias).
using PreMulSumSupplement = c10d::NCCLPreMulSumSupplement;

// OpType entries of the coalesced tensor collectives: their own entries from
// 2.12 (reduce-scatter) and 2.14 (all-gather), the generic COALESCED before.
#if KAITIAN_TORCH_AT_LEAST(2, 12)
constexpr c10d::OpType kReduceScatterTensorCoalesced = c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED;
#else
constexpr c10d::OpType kReduceScatterTensorCoalesced = c10d::OpType::COALESCED;
#endif
#if KAITIAN_TORCH_AT_LEAST(2, 14)
constexpr c10d::OpType kAllgatherIntoTensorCoalesced = c10d::OpType::ALLGATHER_INTO_TENSOR_COALESCED;
#else
constexpr c10d::OpType kAllgatherIntoTensorCoalesced = c10d::OpType::COALESCED;
#endif

// Shut a vendor backend down / abort it where torch lets a caller do so (2.7+);
// before, dropping the last reference is what ends it.
inline void shutdownBackend(c10d::Backend& backend) {
#if KAITIAN_TORCH_AT_LEAST(2, 7)
  backend.shutdown();
#else
  (void)backend;
#endif
}
inline void abortBackend(c10d::Backend& backend) {
#if KAITIAN_TORCH_AT_LEAST(2, 7)
  backend.abort();
#else
  (void)backend;
#endif
}

// `bytes` of pinned host memory from `type`'s own host allocator (torch's
// Context takes the device type from 2.13, the oldest release checked for
// it); before, the default accelerator's, which in a kaitian worker is the
// rank's own (only its vendor's plug-in is loaded).
inline at::Tensor pinnedBytes(int64_t bytes, c10::DeviceType type) {
#if KAITIAN_TORCH_AT_LEAST(2, 13)
  return at::detail::empty_generic({bytes}, at::globalContext().getPinnedMemoryAllocator(type),
                                   c10::DispatchKeySet(c10::DispatchKey::CPU), at::kByte,
                                   std::nullopt);
#else
  (void)type;
  return at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
#endif
}

}  // namespace compat
}  // namespace kaitian
