// Kernels of the fake accelerator: a boxed fallback that runs the CPU kernel on
// host aliases of device memory, queued on the current stream, plus the
// memory-layout kernels and the copies.
#include <ATen/EmptyTensor.h>
#include <ATen/InferSize.h>
#include <ATen/TensorUtils.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <future>
#include <thread>
#include <unordered_map>

#include "fake.hpp"

namespace fake {

// --- host aliases ----------------------------------------------------------------

// A CPU tensor over the same bytes, not owning them: queued work must not keep
// freed device memory alive (a missing record_stream has to show).
at::Tensor host_alias(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != kDev) return t;
  auto st = t.storage();
  c10::Storage cpu(c10::Storage::use_byte_size_t(), st.nbytes(),
                   c10::DataPtr(st.mutable_data(), c10::Device(c10::kCPU)), nullptr, false);
  return at::empty({0}, t.options().device(c10::kCPU)).set_(cpu, t.storage_offset(), t.sizes(), t.strides());
}

struct Converter {  // device tensors -> meta or CPU alias tensors, one storage per device storage
  bool meta;
  std::unordered_map<c10::StorageImpl*, at::Tensor> bases;    // device storage -> converted base
  std::unordered_map<c10::StorageImpl*, c10::Storage> back;   // converted storage -> device storage
  at::Tensor tensor(const at::Tensor& t) {
    if (!t.defined() || t.device().type() != kDev) return t;
    auto key = t.storage().unsafeGetStorageImpl();
    at::Tensor base;
    auto it = bases.find(key);
    if (it != bases.end()) {
      base = it->second;
    } else {
      auto n = (int64_t)(t.storage().nbytes());
      if (meta) {
        base = at::empty({n}, t.options().dtype(at::kByte).device(c10::kMeta));
      } else {
        c10::Storage cpu(c10::Storage::use_byte_size_t(), n,
                         c10::DataPtr(t.storage().mutable_data(), c10::Device(c10::kCPU)), nullptr, false);
        base = at::empty({0}, t.options().dtype(at::kByte).device(c10::kCPU)).set_(cpu);
      }
      bases[key] = base;
      back[base.storage().unsafeGetStorageImpl()] = t.storage();
    }
    auto out = at::empty({0}, t.options().device(base.device()));
    out.set_(base.storage(), t.storage_offset(), t.sizes(), t.strides());
    back[out.storage().unsafeGetStorageImpl()] = t.storage();
    return out;
  }
  c10::IValue value(const c10::IValue& v) {
    if (v.isTensor()) return tensor(v.toTensor());
    if (v.isTensorList()) {
      c10::List<at::Tensor> l;
      for (const at::Tensor& t : v.toTensorList()) l.push_back(tensor(t));
      return l;
    }
    if (v.isList()) {
      auto src = v.toList();
      if (src.size() && (src.get(0).isTensor() || src.get(0).isNone())) {
        c10::List<c10::optional<at::Tensor>> l;
        for (size_t i = 0; i < src.size(); ++i) {
          auto e = src.get(i);
          l.push_back(e.isNone() ? c10::optional<at::Tensor>() : c10::optional<at::Tensor>(tensor(e.toTensor())));
        }
        return l;
      }
      return v;
    }
    if (v.isDevice() && v.toDevice().type() == kDev) return c10::Device(meta ? c10::kMeta : c10::kCPU);
    return v;
  }
  std::vector<c10::IValue> values(const std::vector<c10::IValue>& v) {
    std::vector<c10::IValue> out;
    for (auto& x : v) out.push_back(value(x));
    return out;
  }
};

static c10::DeviceIndex find_device(const std::vector<c10::IValue>& args) {
  for (auto& v : args) {
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().type() == kDev) return v.toTensor().device().index();
    if (v.isTensorList())
      for (const at::Tensor& t : v.toTensorList())
        if (t.device().type() == kDev) return t.device().index();
    if (v.isList())
      for (size_t i = 0; i < v.toList().size(); ++i) {
        auto e = v.toList().get(i);
        if (e.isTensor() && e.toTensor().device().type() == kDev) return e.toTensor().device().index();
      }
    if (v.isDevice() && v.toDevice().type() == kDev) return v.toDevice().has_index() ? v.toDevice().index() : -1;
  }
  return -1;
}

static at::Tensor device_empty(c10::IntArrayRef size, c10::IntArrayRef stride, at::ScalarType dtype, c10::DeviceIndex d) {
  c10::DeviceGuard g(c10::Device(kDev, d));
  return at::detail::empty_strided_generic(size, stride, device_allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), dtype);
}

// A converted output -> the device tensor: a view of a device input's storage,
// the input itself (in-place), or a fresh device tensor (to be filled).
static at::Tensor to_device(const at::Tensor& t, Converter& c, const std::vector<c10::IValue>& args,
                            c10::DeviceIndex d, bool& fresh) {
  fresh = false;
  if (!t.defined()) return t;
  auto it = c.back.find(t.storage().unsafeGetStorageImpl());
  if (it == c.back.end()) {
    fresh = true;
    return device_empty(t.sizes(), t.strides(), t.scalar_type(), d);
  }
  for (auto& a : args)
    if (a.isTensor() && a.toTensor().defined() && a.toTensor().storage().is_alias_of(it->second) &&
        a.toTensor().sizes() == t.sizes() && a.toTensor().strides() == t.strides() &&
        a.toTensor().storage_offset() == t.storage_offset() && a.toTensor().dtype() == t.dtype())
      return a.toTensor();
  auto out = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(it->second),
                                                       c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides());
  out.unsafeGetTensorImpl()->set_storage_offset(t.storage_offset());
  return out;
}

static std::vector<c10::IValue> call(const c10::OperatorHandle& op, std::vector<c10::IValue> args) {
  at::AutoDispatchBelowADInplaceOrView guard;
  op.callBoxed(&args);
  return args;
}

static const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size, c10::optional<at::MemoryFormat> mf);

static void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  auto nargs = schema.arguments().size();
  std::vector<c10::IValue> args(stack->end() - nargs, stack->end());
  torch::jit::drop(*stack, nargs);
  auto d = find_device(args);
  if (d < 0) d = c10::impl::getDeviceGuardImpl(kDev)->getDevice().index();
  bool view_only = !schema.is_mutable() && !schema.returns().empty();
  for (auto& r : schema.returns()) view_only = view_only && r.alias_info() && !r.alias_info()->isWrite();

  // Shapes through Meta, then the CPU kernel queued on the current stream.
  Converter mc{true};
  std::vector<c10::IValue> outs, meta_args;
  bool queued = true;
  try {
    meta_args = mc.values(args);
    outs = call(op, meta_args);
    for (auto& o : outs) queued = queued && (o.isTensor() || o.isTensorList() || o.isNone());
  } catch (const std::exception&) {
    queued = false;
  }
  if (queued) {
    std::vector<c10::IValue> result;
    std::vector<std::pair<at::Tensor, at::Tensor>> fill;  // (device out, where the CPU result goes: index)
    std::vector<std::pair<size_t, int64_t>> where;
    for (size_t i = 0; i < outs.size(); ++i) {
      bool fresh;
      if (outs[i].isTensor()) {
        auto t = to_device(outs[i].toTensor(), mc, args, d, fresh);
        result.push_back(t);
        if (fresh) { fill.push_back({t, host_alias(t)}); where.push_back({i, -1}); }
      } else if (outs[i].isTensorList()) {
        c10::List<at::Tensor> l;
        auto ml = outs[i].toTensorList();
        for (size_t j = 0; j < ml.size(); ++j) {
          auto t = to_device(ml.get(j), mc, args, d, fresh);
          l.push_back(t);
          if (fresh) { fill.push_back({t, host_alias(t)}); where.push_back({i, (int64_t)j}); }
        }
        result.push_back(l);
      } else {
        result.push_back(outs[i]);
      }
    }
    // out= arguments whose size Meta changed: resize them on the device first.
    for (size_t i = 0; i < nargs; ++i) {
      auto ai = schema.arguments()[i].alias_info();
      if (ai && ai->isWrite() && args[i].isTensor() && args[i].toTensor().defined() &&
          args[i].toTensor().sizes() != meta_args[i].toTensor().sizes())
        resize_(args[i].toTensor(), meta_args[i].toTensor().sizes(), c10::nullopt);
    }
    if (!view_only) {
      Converter cc{false};
      auto cpu_args = cc.values(args);
      std::vector<at::Tensor> dst;
      for (auto& f : fill) dst.push_back(f.second);
      auto handle = op;
      enqueue(current(d), [handle, cpu_args, dst, where] {
        auto outs = call(handle, cpu_args);
        for (size_t k = 0; k < where.size(); ++k) {
          auto& o = outs[where[k].first];
          at::Tensor r = where[k].second < 0 ? o.toTensor() : o.toTensorList().get(where[k].second);
          const_cast<at::Tensor&>(dst[k]).copy_(r);
        }
      });
    }
    for (auto& r : result) stack->push_back(r);
    return;
  }
  // Inline: data-dependent shapes and host results wait for the stream.
  synchronize(current(d));
  Converter cc{false};
  outs = call(op, cc.values(args));
  for (auto& o : outs) {
    bool fresh;
    if (o.isTensor()) {
      auto t = to_device(o.toTensor(), cc, args, d, fresh);
      if (fresh) host_alias(t).copy_(o.toTensor());
      stack->push_back(t);
    } else if (o.isTensorList()) {
      c10::List<at::Tensor> l;
      for (const at::Tensor& x : o.toTensorList()) {
        auto t = to_device(x, cc, args, d, fresh);
        if (fresh) host_alias(t).copy_(x);
        l.push_back(t);
      }
      stack->push_back(l);
    } else {
      stack->push_back(o);
    }
  }
}

// --- explicit kernels ----------------------------------------------------------

static at::Tensor empty_memory_format(c10::IntArrayRef size, c10::optional<at::ScalarType> dtype,
                                      c10::optional<at::Layout>, c10::optional<at::Device> device,
                                      c10::optional<bool>, c10::optional<at::MemoryFormat> mf) {
  c10::OptionalDeviceGuard g(device);
  return at::detail::empty_generic(size, device_allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), mf);
}
static at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, c10::optional<at::ScalarType> dtype,
                                c10::optional<at::Layout>, c10::optional<at::Device> device, c10::optional<bool>) {
  c10::OptionalDeviceGuard g(device);
  return at::detail::empty_strided_generic(size, stride, device_allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), c10::dtype_or_default(dtype));
}

static void ensure_bytes(const at::Tensor& self, size_t nbytes) {
  auto st = self.storage();
  if (nbytes <= st.nbytes()) return;
  c10::DeviceGuard g(self.device());
  auto fresh = device_allocator()->allocate(nbytes);
  synchronize(current(self.device().index()));
  if (st.nbytes()) std::memcpy(fresh.get(), st.data(), st.nbytes());
  st.set_data_ptr_noswap(std::move(fresh));
  st.set_nbytes(nbytes);
}

static const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size, c10::optional<at::MemoryFormat> mf) {
  auto impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  if (mf) impl->empty_tensor_restride(*mf);
  auto n = at::detail::computeStorageNbytes(self.sizes(), self.strides(), self.dtype().itemsize(), self.storage_offset());
  ensure_bytes(self, n);
  return self;
}

static at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
                               c10::IntArrayRef stride) {
  auto impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_sizes_and_strides(size, stride);
  impl->set_storage_offset(offset);
  ensure_bytes(self, at::detail::computeStorageNbytes(size, stride, self.dtype().itemsize(), offset));
  return self;
}
static at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  int64_t n = source.nbytes() / self.dtype().itemsize();
  return set_storage(self, source, 0, {n}, {1});
}
static at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& src) {
  return set_storage(self, src.storage(), src.storage_offset(), src.sizes(), src.strides());
}
static at::Tensor& set_empty(at::Tensor& self) {
  c10::DeviceGuard g(self.device());
  c10::Storage st(c10::Storage::use_byte_size_t(), 0, device_allocator(), true);
  return set_storage(self, st, 0, {0}, {1});
}

static at::Tensor as_strided_kernel(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                             c10::optional<int64_t> offset) {
  auto out = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(self.storage()),
                                                       c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), self.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(size, stride);
  out.unsafeGetTensorImpl()->set_storage_offset(offset.value_or(self.storage_offset()));
  return out;
}

static at::Tensor view_kernel(const at::Tensor& self, c10::IntArrayRef size) {
  auto shape = at::infer_size_dv(size, self.numel());
  auto stride = at::detail::computeStride(self.sizes(), self.strides(), shape);
  TORCH_CHECK(stride.has_value(), "view size is not compatible with input tensor's size and stride; use .reshape(...)");
  return as_strided_kernel(self, shape, *stride, self.storage_offset());
}

static bool is_pinned_host(const at::Tensor& t) {
  return at::detail::getPrivateUse1Hooks().isPinnedPtr(t.storage().data());
}

// dst.copy_(src) where at least one is on the device.
static at::Tensor& copy_(at::Tensor& dst, const at::Tensor& src, bool non_blocking) {
  if (dst.numel() == 0) return dst;
  bool to_dev = dst.device().type() == kDev, from_dev = src.device().type() == kDev;
  auto d = to_dev ? dst.device().index() : src.device().index();
  FStream* s = current(d);
  if (to_dev && from_dev && src.device() != dst.device()) block_on(record_mark(current(src.device().index()), false), s);
  auto a = host_alias(dst);
  // A pageable host source is staged at once (as CUDA does); a pinned one is read when the copy runs.
  auto b = (!from_dev && non_blocking && !is_pinned_host(src)) ? src.clone() : host_alias(src);
  at::Tensor keep_src = from_dev ? at::Tensor() : src, keep_dst = to_dev ? at::Tensor() : dst;
  enqueue(s, [a, b, keep_src, keep_dst]() mutable { a.copy_(b); });
  if (!non_blocking && !(to_dev && from_dev)) synchronize(s);
  return dst;
}
static at::Tensor copy_from_kernel(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  at::Tensor d = dst;
  copy_(d, self, non_blocking);
  return dst;
}
static at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.device().type() == kDev) resize_(dst, self.sizes(), c10::nullopt);
  else const_cast<at::Tensor&>(dst).resize_(self.sizes());
  return copy_from_kernel(self, dst, false);
}

static at::Scalar local_scalar_dense(const at::Tensor& self) {
  synchronize(current(self.device().index()));
  return host_alias(self).item();
}

static void record_stream_op(at::Tensor& self, c10::Stream s) {
  record_stream(self.storage().data_ptr(), from_c10(s));
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided_kernel);
  m.impl("view", view_kernel);
  m.impl("resize_", resize_);
  m.impl("copy_", copy_);
  m.impl("_copy_from", copy_from_kernel);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("record_stream", record_stream_op);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_", set_empty);
}

// --- Python --------------------------------------------------------------------

static void sleep_on_current(double seconds) {
  auto d = c10::impl::getDeviceGuardImpl(kDev)->getDevice().index();
  enqueue(current(d), [seconds] { std::this_thread::sleep_for(std::chrono::duration<double>(seconds)); });
}

// A gate on a stream: what is queued behind it waits until release() (or the
// gate is dropped), however long the host takes meanwhile. Where sleep() only
// makes a missing wait likely to show, a gate makes it certain.
struct Gate {
  std::promise<void> open;
  std::shared_future<void> opened = open.get_future().share();
  bool released = false;
  void release() {
    if (!released) {
      released = true;
      open.set_value();
    }
  }
  ~Gate() { release(); }
};

static std::shared_ptr<Gate> hold_current() {
  auto gate = std::make_shared<Gate>();
  auto d = c10::impl::getDeviceGuardImpl(kDev)->getDevice().index();
  enqueue(current(d), [opened = gate->opened] { opened.wait(); });
  return gate;
}

}  // namespace fake

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kaitian's fake accelerator (see kaitian.testing.fake_accelerator)";
  m.def("init", &fake::init, "create N devices, each with its default stream (once per process)");
  m.def("python_exits", &fake::python_exits, py::call_guard<py::gil_scoped_release>(),
        "from now on the streams' workers take no GIL (call at Python's exit)");
  m.def("sleep", &fake::sleep_on_current, "queue a delay of `seconds` on the current stream");
  py::class_<fake::Gate, std::shared_ptr<fake::Gate>>(m, "Gate", "a gate on a stream (see hold)")
      .def("release", &fake::Gate::release, "let the stream go on")
      .def("__enter__", [](std::shared_ptr<fake::Gate> g) { return g; })
      .def("__exit__", [](fake::Gate& g, py::args) { g.release(); });
  m.def("hold", &fake::hold_current, "queue a gate on the current stream; it holds what follows until released");
  fake::bind_cncl(m);
  m.def("host_alias", &fake::host_alias, "a CPU tensor over the same bytes as a device tensor (not owning them)");
  m.def("enqueue", [](c10::DeviceIndex d, py::function fn) {
    auto f = new py::function(std::move(fn));  // released under the GIL, on the worker (kept once Python exits)
    fake::enqueue(fake::current(d), [f] {
      std::string error;
      fake::with_python([&] {
        py::gil_scoped_acquire g;
        try {
          (*f)();
        } catch (py::error_already_set& e) {
          error = e.what();
        }
        delete f;
      });
      if (!error.empty()) throw std::runtime_error(error);
    });
  }, "queue a Python callable on the current stream of device d");
}
