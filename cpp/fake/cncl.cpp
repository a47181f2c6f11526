// The fake accelerator's `cncl` c10d backend: behaves like torch_mlu's
// ProcessGroupCNCL (and ProcessGroupNCCL) towards streams, with CNCL's dtype and
// reduce-op limits. Each op runs on the backend's communication stream, which
// first waits for the caller's current stream; its tensors are record_stream'ed
// there; Work::wait() makes the caller's current stream wait, not the host; the
// future is completed at once with an event on the communication stream. The
// data moves through a gloo group over host aliases of the device memory, run
// from the communication stream's worker thread, so a caller that reads a result
// without waiting sees stale memory, as on a real device.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <c10/core/StreamGuard.h>
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <mutex>

#include "fake.hpp"

namespace fake {
namespace {

namespace py = pybind11;
using c10d::OpType;
using RedOp = c10d::ReduceOp;

// What CNCL carries each dtype as (torch_mlu's cncl_data_type): bool as uint8;
// float64 is refused here, where torch_mlu sends it as cnclFloat and so rounds
// every element (or moves half the bytes) without a word.
at::ScalarType carried(at::ScalarType t, const char* op) {
  switch (t) {
    case at::kFloat: case at::kHalf: case at::kBFloat16: case at::kChar: case at::kByte:
    case at::kInt: case at::kLong:
      return t;
    case at::kBool:
      return at::kByte;
    case at::kDouble:
      TORCH_CHECK(false, "fake cncl ", op, ": float64 is not supported: CNCL has no float64 type "
                  "(torch_mlu would send it as float32, rounding every element); use float32, or "
                  "backend kaitian, which reduces float64 on the host");
    default:
      TORCH_CHECK(false, "fake cncl ", op, ": ", c10::getDtypeNames(t).first, " is not supported: CNCL "
                  "carries float32, float16, bfloat16, int8, uint8, int32, int64 and bool");
  }
}

// The op CNCL reduces with (torch_mlu's getCnclReduceOp): a bool SUM is a MAX
// over uint8; AVG is a SUM with a division before (floats) or after (integers).
RedOp::RedOpType cnclOp(const RedOp& op, at::ScalarType t, const char* name) {
  switch (op.op_) {
    case RedOp::SUM:
      return t == at::kBool ? RedOp::MAX : RedOp::SUM;
    case RedOp::AVG:
      TORCH_CHECK(t != at::kBool, "fake cncl ", name, ": cannot use ReduceOp.AVG with boolean inputs");
      return RedOp::SUM;
    case RedOp::PRODUCT: case RedOp::MIN: case RedOp::MAX:
      return op.op_;
    case RedOp::BAND:
      TORCH_CHECK(false, "fake cncl ", name, ": cannot use ReduceOp.BAND with CNCL");
    case RedOp::BOR:
      TORCH_CHECK(false, "fake cncl ", name, ": cannot use ReduceOp.BOR with CNCL");
    case RedOp::BXOR:
      TORCH_CHECK(false, "fake cncl ", name, ": cannot use ReduceOp.BXOR with CNCL");
    default:
      TORCH_CHECK(false, "fake cncl ", name, ": ReduceOp.PREMUL_SUM is not supported by CNCL");
  }
}

// A device tensor's bytes as a CPU tensor of the dtype CNCL carries it in.
at::Tensor wire(const at::Tensor& t) {
  auto h = host_alias(t);
  return h.scalar_type() == at::kBool ? h.view(at::kByte) : h;
}

// The first failure of a backend's ops, after which (as a CNCL communicator
// in error) it refuses every later op.
struct Failure {
  std::mutex mu;
  std::string first;
  std::string get() {
    std::lock_guard<std::mutex> g(mu);
    return first;
  }
  void set(const std::string& e) {
    std::lock_guard<std::mutex> g(mu);
    if (first.empty()) first = e;
  }
};

// One op's outcome, set on the communication stream.
struct OpState {
  std::string name;
  Failure error;
};

class CnclWork : public c10d::Work {
 public:
  CnclWork(int rank, OpType type, c10::DeviceIndex device, Mark end, std::shared_ptr<OpState> op,
           std::vector<at::Tensor> outputs, c10::intrusive_ptr<c10::ivalue::Future> future,
           bool hostBlocking)
      : c10d::Work(rank, type),
        device_(device),
        end_(std::move(end)),
        op_(std::move(op)),
        outputs_(std::move(outputs)),
        future_(std::move(future)),
        hostBlocking_(hostBlocking) {}

  // Done once its task on the communication stream ran; an error met there is
  // then the Work's exception (as NCCL's Work reports an asynchronous error).
  bool isCompleted() override {
    if (!passed(end_)) return false;
    auto e = op_->error.get();
    std::lock_guard<std::mutex> lock(mutex_);
    if (!e.empty() && !exception_) {
      exception_ = std::make_exception_ptr(std::runtime_error("fake cncl " + op_->name + " failed: " + e));
    }
    return true;
  }
  bool isSuccess() const override { return passed(end_) && op_->error.get().empty(); }
  bool wait(std::chrono::milliseconds = kNoTimeout) override {
    raiseIfFailed();
    if (hostBlocking_) {  // a barrier holds the host, as NCCL's does
      wait_for(end_);
      raiseIfFailed();
      return true;
    }
    // The caller's current stream waits for the op; an error reaches it there.
    auto end = end_;
    auto op = op_;
    enqueue(current(device_), [end, op] {
      wait_for(end);
      auto e = op->error.get();
      if (!e.empty()) throw std::runtime_error("fake cncl " + op->name + " failed: " + e);
    });
    return true;
  }
  void synchronize() override { wait(); }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  void raiseIfFailed() const {
    auto e = op_->error.get();
    TORCH_CHECK(e.empty(), "fake cncl ", op_->name, " failed: ", e);
  }
  c10::DeviceIndex device_;
  Mark end_;  // the op's task on the communication stream
  std::shared_ptr<OpState> op_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  bool hostBlocking_;
};

class ProcessGroupCNCL : public c10d::Backend {
 public:
  ProcessGroupCNCL(c10::intrusive_ptr<c10d::Backend> transport, int rank, int size)
      : c10d::Backend(rank, size), transport_(std::move(transport)) {}

  const std::string getBackendName() const override { return "cncl"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    return reduction("allreduce", OpType::ALLREDUCE, tensors, opts.reduceOp, true);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    auto t = one("broadcast", tensors);
    carried(t.scalar_type(), "broadcast");
    auto tr = transport_;
    const auto root = opts.rootRank;
    return post("broadcast", OpType::BROADCAST, {t}, {t}, [tr, w = wire(t), root] {
      std::vector<at::Tensor> v{w};
      c10d::BroadcastOptions o;
      o.rootRank = root;
      tr->broadcast(v, o)->wait();
    });
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    return reduction("reduce", OpType::REDUCE, tensors, opts.reduceOp, opts.rootRank == getRank());
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions&) override {
    auto in = one("allgather", inputs);
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(),
                "fake cncl allgather: expects one output list of ", getSize(), " tensors");
    carried(in.scalar_type(), "allgather");
    auto outs = outputs[0];
    std::vector<at::Tensor> all = outs;
    all.push_back(in);
    std::vector<at::Tensor> o;
    for (const auto& t : outs) o.push_back(wire(t));
    auto tr = transport_;
    return post("allgather", OpType::ALLGATHER, all, outs, [tr, i = wire(in), o] {
      std::vector<at::Tensor> iv{i};
      std::vector<std::vector<at::Tensor>> ov{o};
      tr->allgather(ov, iv)->wait();
    });
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions&) override {
    TORCH_CHECK(output.numel() == input.numel() * getSize() && output.scalar_type() == input.scalar_type(),
                "fake cncl allgather_into_tensor: the output must hold world size x the input, same dtype");
    carried(input.scalar_type(), "allgather_into_tensor");
    at::Tensor out = output, in = input;
    auto tr = transport_;
    return post("allgather_into_tensor", OpType::_ALLGATHER_BASE, {in, out}, {out},
                [tr, i = wire(in).reshape({-1}), o = wire(out).reshape({-1}).chunk(getSize())] {
                  std::vector<at::Tensor> iv{i};
                  std::vector<std::vector<at::Tensor>> ov{o};
                  tr->allgather(ov, iv)->wait();
                });
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    auto out = one("reduce_scatter", outputs);
    TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(),
                "fake cncl reduce_scatter: expects one input list of ", getSize(), " tensors");
    for (const auto& t : inputs[0]) {
      TORCH_CHECK(t.numel() == out.numel() && t.scalar_type() == out.scalar_type(),
                  "fake cncl reduce_scatter: every input must match the output's size and dtype");
    }
    std::vector<at::Tensor> all = inputs[0];
    all.push_back(out);
    return reduceScatter("reduce_scatter", OpType::REDUCE_SCATTER, all, out, opts.reduceOp);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    TORCH_CHECK(input.numel() == output.numel() * getSize() && input.scalar_type() == output.scalar_type(),
                "fake cncl reduce_scatter_tensor: the input must hold world size x the output, same dtype");
    return reduceScatter("reduce_scatter_tensor", OpType::_REDUCE_SCATTER_BASE, {input, output}, output,
                         opts.reduceOp);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions&) override {
    TORCH_CHECK(input.scalar_type() == output.scalar_type(),
                "fake cncl alltoall_base: input and output dtypes differ");
    carried(input.scalar_type(), "alltoall_base");
    at::Tensor out = output, in = input;
    auto tr = transport_;
    return post("alltoall_base", OpType::ALLTOALL_BASE, {in, out}, {out},
                [tr, i = wire(in), o = wire(out), outputSplits, inputSplits]() mutable {
                  auto os = outputSplits, is = inputSplits;
                  tr->alltoall_base(o, i, os, is)->wait();
                });
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    // On the device of the ops so far, else the current one (torch_mlu guesses too).
    c10::DeviceIndex d = device_ >= 0 ? device_ : c10::impl::getDeviceGuardImpl(kDev)->getDevice().index();
    auto t = at::empty({1}, at::TensorOptions().device(kDev, d));
    auto tr = transport_;
    return post("barrier", OpType::BARRIER, {t}, {}, [tr] { tr->barrier()->wait(); }, kCollectives, true);
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    return p2p("send", OpType::SEND, tensors, kSends,
               [dst, tag](c10d::Backend& tr, std::vector<at::Tensor>& v) { return tr.send(v, dst, tag); });
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return p2p("recv", OpType::RECV, tensors, kRecvs,
               [src, tag](c10d::Backend& tr, std::vector<at::Tensor>& v) { return tr.recv(v, src, tag); });
  }

 private:
  // The one tensor of an op (one device per process).
  static at::Tensor one(const char* op, const std::vector<at::Tensor>& tensors) {
    TORCH_CHECK(tensors.size() == 1, "fake cncl ", op, ": expects one tensor, got ", tensors.size());
    return tensors[0];
  }

  // SUM (or the op CNCL uses instead) of `v` over the group; AVG as torch_mlu does it.
  static void reduceOn(const c10::intrusive_ptr<c10d::Backend>& tr, std::vector<at::Tensor>& v,
                       RedOp::RedOpType op, bool avg, int W) {
    const bool floating = at::isFloatingType(v[0].scalar_type());
    if (avg && floating) v[0].div_(W);
    c10d::AllreduceOptions o;
    o.reduceOp = RedOp(op);
    tr->allreduce(v, o)->wait();
    if (avg && !floating) v[0].floor_divide_(W);
  }

  // The tensor reduced over the group in a host copy, which this rank keeps
  // (allreduce) or not (reduce, off the root).
  c10::intrusive_ptr<c10d::Work> reduction(const char* name, OpType type, const std::vector<at::Tensor>& tensors,
                                           const RedOp& redop, bool keep) {
    auto t = one(name, tensors);
    carried(t.scalar_type(), name);
    const auto op = cnclOp(redop, t.scalar_type(), name);
    const bool avg = redop.op_ == RedOp::AVG;
    auto tr = transport_;
    const int W = getSize();
    return post(name, type, {t}, {t}, [tr, w = wire(t), op, avg, W, keep] {
      std::vector<at::Tensor> v{w.clone()};
      reduceOn(tr, v, op, avg, W);
      if (keep) w.copy_(v[0]);
    });
  }

  c10::intrusive_ptr<c10d::Work> reduceScatter(const char* name, OpType type, std::vector<at::Tensor> all,
                                               at::Tensor out, const RedOp& redop) {
    carried(out.scalar_type(), name);
    const auto op = cnclOp(redop, out.scalar_type(), name);
    const bool avg = redop.op_ == RedOp::AVG;
    std::vector<at::Tensor> parts;  // the input(s), flat
    for (auto it = all.begin(); it + 1 != all.end(); ++it) parts.push_back(wire(*it).reshape({-1}));
    auto tr = transport_;
    const int W = getSize(), me = getRank();
    return post(name, type, all, {out}, [tr, parts, o = wire(out).reshape({-1}), op, avg, W, me]() mutable {
      // The whole input reduced in a host copy; this rank keeps its block.
      std::vector<at::Tensor> v{at::cat(parts)};
      reduceOn(tr, v, op, avg, W);
      o.copy_(v[0].chunk(W)[me]);
    });
  }

  // Communication streams: collectives on one; sends and receives each on
  // their own, so that a send and a receive between two ranks never wait for
  // each other in one FIFO (NCCL's small sends complete without the receiver).
  enum Lane { kCollectives, kSends, kRecvs, kLanes };

  using Transfer = std::function<c10::intrusive_ptr<c10d::Work>(c10d::Backend&, std::vector<at::Tensor>&)>;
  c10::intrusive_ptr<c10d::Work> p2p(const char* name, OpType type, const std::vector<at::Tensor>& tensors,
                                     Lane lane, Transfer transfer) {
    auto t = one(name, tensors);
    carried(t.scalar_type(), name);
    auto tr = transport_;
    return post(name, type, {t}, {t}, [tr, w = wire(t), transfer] {
      std::vector<at::Tensor> v{w};
      transfer(*tr, v)->wait();
    }, lane);
  }

  // Queues `run` on a communication stream after the caller's current stream
  // and returns its Work (NCCL's pattern; see the file comment).
  c10::intrusive_ptr<c10d::Work> post(const char* name, OpType type, const std::vector<at::Tensor>& tensors,
                                      std::vector<at::Tensor> outputs, std::function<void()> run,
                                      Lane lane = kCollectives, bool hostBlocking = false) {
    auto earlier = failure_->get();
    TORCH_CHECK(earlier.empty(), "fake cncl ", name, ": an earlier op of this group failed (", earlier,
                "); the communicator is unusable, create a new process group");
    c10::DeviceIndex d = -1;
    for (const auto& t : tensors) {
      TORCH_CHECK(t.device().type() == kDev, "fake cncl ", name, ": CNCL only supports ",
                  c10::DeviceTypeName(kDev, true), " tensors, got a tensor on ", t.device());
      TORCH_CHECK(t.is_contiguous(), "fake cncl ", name, ": tensors must be contiguous");
      TORCH_CHECK(d < 0 || t.device().index() == d, "fake cncl ", name, ": tensors on several devices");
      d = t.device().index();
    }
    TORCH_CHECK(device_ < 0 || device_ == d, "fake cncl ", name, ": this group runs on device ", int(device_),
                ", got a tensor on device ", int(d), " (one device per process group)");
    if (device_ < 0) {
      device_ = d;
      for (auto& s : streams_) s = new_stream(d);
    }
    FStream* comm = streams_[lane];
    block_on(record_mark(current(d), false), comm);
    for (const auto& t : tensors) record_stream(t.storage().data_ptr(), comm);
    auto op = std::make_shared<OpState>();
    op->name = name;
    auto failure = failure_;
    const int rank = getRank();
    Mark end{comm, enqueue(comm, [run, op, failure, rank] {
      try {
        run();
      } catch (const std::exception& e) {
        std::string what = c10::str("rank ", rank, "'s ", op->name, ": ", e.what());
        op->error.set(what);
        failure->set(what);
        throw;
      }
    }), nullptr};
    // Completed now, with an event on the communication stream (as NCCL's).
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                           std::vector<c10::Device>{c10::Device(kDev, d)});
    {
      c10::StreamGuard on(as_c10(comm));
      future->markCompleted(c10::IValue(outputs));
    }
    return c10::make_intrusive<CnclWork>(rank, type, d, end, op, std::move(outputs), future, hostBlocking);
  }

  c10::intrusive_ptr<c10d::Backend> transport_;  // gloo, over host aliases
  std::shared_ptr<Failure> failure_ = std::make_shared<Failure>();
  c10::DeviceIndex device_ = -1;  // fixed by the first op
  FStream* streams_[kLanes] = {};  // its communication streams
};

// torch_mlu's ProcessGroupCNCL.Options: the fields a caller sets.
struct Options {
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
  std::vector<uint64_t> global_ranks_in_group;
  std::string group_name;
};

// A group over `store`, shaped as torch_mlu's: its gloo transport on its own
// store prefix, with the group's timeout.
c10::intrusive_ptr<ProcessGroupCNCL> create(const py::object& store, int rank, int size,
                                            std::chrono::milliseconds timeout) {
  auto dist = py::module_::import("torch.distributed");
  auto transport = dist.attr("ProcessGroupGloo")(dist.attr("PrefixStore")("fake-cncl/", store), rank, size, timeout);
  return c10::make_intrusive<ProcessGroupCNCL>(transport.cast<c10::intrusive_ptr<c10d::Backend>>(), rank, size);
}

}  // namespace

void bind_cncl(py::module_& m) {
  py::module_::import("torch.distributed");  // registers c10d::Backend and Store with pybind
  auto cls = py::class_<ProcessGroupCNCL, c10d::Backend, c10::intrusive_ptr<ProcessGroupCNCL>>(
      m, "ProcessGroupCNCL", "the fake accelerator's cncl backend (as torch_mlu's: store, rank, size, options or timeout)");
  py::class_<Options>(cls, "Options")
      .def(py::init<>())
      .def_readwrite("_timeout", &Options::timeout)
      .def_readwrite("global_ranks_in_group", &Options::global_ranks_in_group)
      .def_readwrite("group_name", &Options::group_name);
  cls.def(py::init([](const py::object& store, int rank, int size, const Options& options) {
           return create(store, rank, size, options.timeout);
         }),
         py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("options"))
      .def(py::init(&create), py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"));
}

}  // namespace fake
