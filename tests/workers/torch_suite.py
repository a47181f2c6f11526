"""Runs PyTorch's own distributed test suite against kaitian (or gloo).

``torch/testing/_internal/distributed/distributed_test.py`` holds the common
suite every c10d backend is checked with (``DistributedTest._DistTestBase``,
selected by ``BACKEND``). This runner registers kaitian and lists it in
``DistTestCases.backend_feature`` *before* the suite is imported (the suite
reads both at import time), splits the ranks into two simulated vendor groups
(``KAITIAN_GROUP``: the first half of the ranks in ``cpu0``, the rest in
``cpu1``) and runs a selection of the collective and DDP tests. Ranks are
forked from this process (the suite's default is spawn, which re-imports the
11 000-line suite in every rank of every test: ~10x slower here).

Usage::

    python tests/torch_suite/run_suite.py --backend kaitian --json out.json
    python tests/torch_suite/run_suite.py --backend gloo -k test_all_reduce
    python tests/torch_suite/run_suite.py --backend kaitian --select all

Prints one line per test and a summary ``passed N skipped N failed N``;
``--json`` writes ``{test: {"outcome": pass|skip|fail, "detail": ...}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import unittest

__all__ = ["SELECTION", "main"]


def _early_args(argv):
    """``--backend`` / ``--world-size`` / ``--as-gloo`` must be known before the suite is imported."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--backend", default=os.environ.get("BACKEND", "kaitian"))
    ap.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", "3")))
    ap.add_argument("--as-gloo", action="store_true")
    known, _ = ap.parse_known_args(argv)
    return known


# Run from a checkout: the repository root holds the kaitian package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_AS_GLOO = False
if __name__ == "__main__":
    _early = _early_args(sys.argv[1:])
    _AS_GLOO = _early.as_gloo and _early.backend == "kaitian"
    # --as-gloo: the suite's import-time decorators see "gloo"; the ranks run kaitian.
    os.environ["BACKEND"] = "gloo" if _AS_GLOO else _early.backend
    os.environ["WORLD_SIZE"] = str(_early.world_size)
os.environ.setdefault("BACKEND", "kaitian")
os.environ.setdefault("WORLD_SIZE", "3")
# A hung collective must cost a minute, not the suite's default five.
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "90")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if os.environ["BACKEND"] == "kaitian" or _AS_GLOO:
    import kaitian  # noqa: E402,F401  registers the backend

from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

if os.environ["BACKEND"] == "kaitian":
    # What kaitian implements: CUDA tensors (through NCCL inside the group), DDP,
    # subgroups; and it is a plugin.
    for _feature in ("gpu", "cuda", "ddp", "subgroup", "plugin"):
        DistTestCases.backend_feature[_feature].add("kaitian")

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


def group_of_rank(rank: int, world_size: int) -> str:
    """The simulated vendor group of ``rank``: first half ``cpu0``, rest ``cpu1``."""
    return "cpu0" if rank < (world_size + 1) // 2 else "cpu1"


class TestKaitianSuite(TestDistBackend, DistributedTest._DistTestBase):
    """The common suite, ranks forked, each rank in its simulated vendor group."""

    def setUp(self):
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        world_size = int(os.environ["WORLD_SIZE"])
        os.environ["KAITIAN_GROUP"] = group_of_rank(rank, world_size)
        os.environ["KAITIAN_DEVICE_TYPE"] = "cpu"
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        if _AS_GLOO:
            _init = dist.init_process_group

            def init_kaitian(*args, **kw):
                if kw.get("backend") == "gloo":
                    kw["backend"] = "kaitian"
                out = _init(*args, **kw)
                if dist.get_backend() != "kaitian":
                    raise RuntimeError(f"--as-gloo: default group is {dist.get_backend()!r}, not kaitian")
                return out

            dist.init_process_group = init_kaitian
        super()._run(rank, test_name, file_name, pipe, **kwargs)


# The collective and DDP tests that apply to CPU ranks. CUDA/NCCL-only tests,
# profiler-format tests and gloo-only timeout tests are left out: on this
# machine they skip (or test gloo itself) whatever the backend.
SELECTION = (
    # collectives
    "test_all_gather", "test_all_gather_coalesced_full_group", "test_all_gather_coalesced_group",
    "test_all_gather_coalesced_simple", "test_all_gather_coalesced_with_empty", "test_all_gather_coalesced_complex",
    "test_all_gather_complex", "test_all_gather_full_group", "test_all_gather_group",
    "test_all_gather_object_default_pg", "test_all_gather_object_subgroup",
    "test_all_reduce_coalesced_full_group_max", "test_all_reduce_coalesced_full_group_min",
    "test_all_reduce_coalesced_full_group_product", "test_all_reduce_coalesced_full_group_sum",
    "test_all_reduce_coalesced_group_max", "test_all_reduce_coalesced_group_min",
    "test_all_reduce_coalesced_group_product", "test_all_reduce_coalesced_group_sum",
    "test_all_reduce_coalesced_max", "test_all_reduce_coalesced_min", "test_all_reduce_coalesced_product",
    "test_all_reduce_coalesced_sum", "test_all_reduce_coalesced_max_complex_unsupported",
    "test_all_reduce_complex_unsupported_ops",
    "test_all_reduce_full_group_max", "test_all_reduce_full_group_min", "test_all_reduce_full_group_product",
    "test_all_reduce_full_group_sum", "test_all_reduce_group_max", "test_all_reduce_group_min",
    "test_all_reduce_group_product", "test_all_reduce_group_sum", "test_all_reduce_max", "test_all_reduce_min",
    "test_all_reduce_product", "test_all_reduce_sum", "test_all_reduce_sum_async", "test_all_reduce_sum_complex",
    "test_sparse_all_reduce_sum",
    "test_all_to_all", "test_all_to_all_complex", "test_all_to_all_full_group", "test_all_to_all_group",
    "test_all_to_all_single_equal_split", "test_all_to_all_single_equal_split_complex",
    "test_all_to_all_single_equal_split_full_group", "test_all_to_all_single_equal_split_group",
    "test_all_to_all_single_unequal_split", "test_all_to_all_single_unequal_split_complex",
    "test_all_to_all_single_unequal_split_full_group", "test_all_to_all_single_unequal_split_group",
    "test_barrier", "test_barrier_full_group", "test_barrier_group",
    "test_batch_isend_irecv_gloo", "test_batch_isend_irecv_gloo_tags", "test_batch_isend_irecv_op_err",
    "test_batch_isend_irecv_op_list_err", "test_batch_isend_irecv_mixed_backend_err",
    "test_broadcast", "test_broadcast_full_group", "test_broadcast_group", "test_broadcast_object_list",
    "test_coalescing_manager", "test_coalescing_manager_async",
    "test_gather", "test_gather_checks", "test_gather_full_group", "test_gather_group", "test_gather_object",
    "test_gather_object_subgroup",
    "test_reduce_full_group_max", "test_reduce_full_group_min", "test_reduce_full_group_product",
    "test_reduce_full_group_sum", "test_reduce_group_max", "test_reduce_group_min", "test_reduce_group_product",
    "test_reduce_group_sum", "test_reduce_max", "test_reduce_min", "test_reduce_product", "test_reduce_sum",
    "test_reduce_sum_twice",
    "test_scatter", "test_scatter_checks", "test_scatter_complex", "test_scatter_full_group", "test_scatter_group",
    "test_scatter_object_list",
    "test_send_recv", "test_send_recv_any_source", "test_send_recv_with_tag", "test_isend", "test_irecv",
    "test_get_future", "test_get_backend", "test_get_rank", "test_get_rank_size_full_group",
    "test_get_rank_size_group", "test_destroy_group", "test_destroy_full_group",
    "test_new_subgroups", "test_new_subgroups_by_enumeration", "test_new_subgroups_with_group_param",
    "test_new_subgroups_overlap_not_allowed", "test_new_subgroups_group_size_exceeds_world_size",
    "test_new_subgroups_world_size_not_divisible_by_group_size",
    "test_new_subgroups_by_enumeration_input_rank_exceeds_world_size",
    "test_new_subgroups_by_enumeration_negative_input_rank",
    # DDP
    "test_DistributedDataParallelCPU", "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad", "test_DistributedSampler_padding",
    "test_SyncBatchNorm_process_group",
    "test_accumulate_gradients_no_sync", "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook", "test_accumulate_gradients_no_sync_grad_is_view",
    "test_average_parameters", "test_periodic_model_averager", "test_periodic_model_averager_param_group",
    "test_1_level_hierarchical_model_averager_equivalent_to_periodic_model_averager",
    "test_3_level_hierarchical_model_averager",
    "test_post_localSGD_optimizer_parity", "test_post_localSGD_optimizer_parity_with_hierarchical_sgd",
    "test_post_localSGD_optimizer_step_reload",
    "test_ddp_broadcast_buffer", "test_ddp_broadcast_buffer_via_hook", "test_ddp_bucket_cap_mb_list",
    "test_ddp_buffer_hook_allreduce", "test_ddp_buffer_hook_allreduce_return_future",
    "test_ddp_comm_hook_logging", "test_ddp_control_flow_different_across_ranks",
    "test_ddp_control_flow_same_across_ranks", "test_ddp_create_graph", "test_ddp_device",
    "test_ddp_forward_backward_hook", "test_ddp_grad_div_uneven_inputs",
    "test_ddp_hook_parity_allreduce", "test_ddp_hook_parity_allreduce_process_group",
    "test_ddp_hook_parity_post_localSGD", "test_ddp_hook_parity_powerSGD", "test_ddp_hook_pickling_powerSGD",
    "test_ddp_ignore_params_arg", "test_ddp_inference", "test_ddp_init_sync_buffers_with_forward_sync_buffers_false",
    "test_ddp_join_model_equivalence", "test_ddp_join_respects_forward_sync_buffers_false",
    "test_ddp_logging_data_cpu", "test_ddp_model_diff_num_params_across_ranks",
    "test_ddp_model_diff_shape_across_ranks", "test_ddp_multiple_nested_unused_params_error",
    "test_ddp_namedtuple", "test_ddp_native_mixed_precision_ignored_params",
    "test_ddp_native_mixed_precision_no_grad_as_bucket_view_no_set_grad_none",
    "test_ddp_new_tensor_in_fwd", "test_ddp_new_tensor_in_fwd_static_graph",
    "test_ddp_remove_autograd_hooks", "test_ddp_returns_tensor_with_no_grad", "test_ddp_shared_grad_acc_unused_params",
    "test_ddp_sink_noclone", "test_ddp_static_graph_nested_types", "test_ddp_sync_module_states",
    "test_ddp_uneven_input_exception", "test_ddp_uneven_input_join_disable", "test_ddp_uneven_inputs",
    "test_ddp_unused_params_rebuild_buckets_exception", "test_ddp_zero_output_features",
    "test_detect_ddp_is_actually_static", "test_different_graph_across_ranks",
    "test_grads_same_across_ranks_with_no_sync", "test_invalid_static_graph",
    "test_output_unused_in_loss_dict_module", "test_output_unused_in_loss_tuple_module",
    "test_skip_all_reduce_unused_parameters", "test_static_graph_api_cpu", "test_static_graph_multi_forward",
    "test_stateless_api_with_ddp", "test_sync_bn_logged", "test_undefined_grad_parity_unused_parameters",
    "test_verify_model_across_rank_with_logger", "test_verify_model_across_rank_without_logger",
)


# Tests the suite runs only when BACKEND is literally "gloo" (or gloo/nccl/ucc),
# although what they check is backend-agnostic: object collectives,
# all_reduce_coalesced, futures of DDP comm hooks, batched p2p, tagged
# send/recv. ``--as-gloo`` runs them with BACKEND=gloo for the suite's gates and
# kaitian as the process group (tests that query the backend's name or use
# gloo-only APIs - monitored_barrier - stay out).
AS_GLOO_TESTS = (
    "test_accumulate_gradients_no_sync", "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook", "test_accumulate_gradients_no_sync_grad_is_view",
    "test_all_gather_object_default_pg", "test_all_gather_object_subgroup",
    "test_all_reduce_coalesced_full_group_max", "test_all_reduce_coalesced_full_group_min",
    "test_all_reduce_coalesced_full_group_product", "test_all_reduce_coalesced_full_group_sum",
    "test_all_reduce_coalesced_max", "test_all_reduce_coalesced_min", "test_all_reduce_coalesced_product",
    "test_all_reduce_coalesced_sum", "test_barrier_timeout_full_group", "test_batch_isend_irecv_gloo", "test_batch_isend_irecv_gloo_tags",
    "test_gather_object", "test_gather_object_subgroup", "test_get_future",
    "test_grads_same_across_ranks_with_no_sync", "test_scatter_object_list", "test_sparse_all_reduce_sum",
)


class _Recorder(unittest.TextTestResult):
    """Keeps every test's outcome (and time) for the JSON report."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes = {}
        self._t0 = 0.0

    def startTest(self, test):
        self._t0 = time.monotonic()
        super().startTest(test)

    def _put(self, test, outcome, detail=""):
        self.outcomes[test._testMethodName] = {
            "outcome": outcome, "detail": detail[-3000:], "seconds": round(time.monotonic() - self._t0, 2)}

    def addSuccess(self, test):
        super().addSuccess(test)
        self._put(test, "pass")

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._put(test, "skip", str(reason))

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._put(test, "fail", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._put(test, "fail", self._exc_info_to_string(err, test))

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._put(test, "pass", "expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._put(test, "fail", "unexpected success")


def main(argv=None) -> int:
    """Runs the selection; returns 0 when no test failed."""
    ap = argparse.ArgumentParser(description="PyTorch's distributed suite against kaitian")
    ap.add_argument("--backend", default=os.environ["BACKEND"], help="kaitian (default) or gloo")
    ap.add_argument("--world-size", type=int, default=int(os.environ["WORLD_SIZE"]))
    ap.add_argument("--select", default="default", choices=("default", "all"),
                    help="default: the collective + DDP selection; all: every test of the suite")
    ap.add_argument("-k", action="append", default=[], help="only tests whose name contains this (repeatable)")
    ap.add_argument("--tests", default="", help="comma list of exact test names (overrides --select)")
    ap.add_argument("--shard", default="", help="I/N: only every N-th test of the selection, from the I-th (0-based)")
    ap.add_argument("--as-gloo", action="store_true",
                    help="run AS_GLOO_TESTS (gated on BACKEND == 'gloo' by the suite) on kaitian")
    ap.add_argument("--json", default="", help="write per-test outcomes here")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.as_gloo and args.backend != "kaitian":
        print("run_suite: --as-gloo is for --backend kaitian", file=sys.stderr)
        return 2
    if (args.backend != os.environ["BACKEND"] and not _AS_GLOO) or str(args.world_size) != os.environ["WORLD_SIZE"]:
        print("run_suite: --backend/--world-size must be given on the command line", file=sys.stderr)
        return 2
    available = set(unittest.TestLoader().getTestCaseNames(TestKaitianSuite))
    if args.tests:
        names = [n for n in args.tests.split(",") if n]
    elif args.as_gloo:
        names = list(AS_GLOO_TESTS)
    elif args.select == "all":
        names = sorted(available)
    else:
        names = list(SELECTION)
    missing = [n for n in names if n not in available]
    if missing:
        print(f"run_suite: not in this torch's suite: {', '.join(missing)}", file=sys.stderr)
        return 2
    if args.k:
        names = [n for n in names if any(k in n for k in args.k)]
    if args.shard:
        index, count = (int(v) for v in args.shard.split("/"))
        names = sorted(names)[index::count]
    suite = unittest.TestSuite(TestKaitianSuite(n) for n in names)
    start = time.monotonic()
    runner = unittest.TextTestRunner(verbosity=1 if args.quiet else 2, resultclass=_Recorder, stream=sys.stdout)
    result = runner.run(suite)
    counts = {k: sum(1 for o in result.outcomes.values() if o["outcome"] == k) for k in ("pass", "skip", "fail")}
    summary = (f"run_suite: backend {args.backend}{' (as gloo)' if args.as_gloo else ''}, world size {args.world_size}: passed {counts['pass']} "
               f"skipped {counts['skip']} failed {counts['fail']} of {len(names)} in "
               f"{time.monotonic() - start:.0f}s")
    print(summary)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"backend": args.backend, "as_gloo": args.as_gloo, "world_size": args.world_size, "counts": counts,
                       "tests": result.outcomes}, fh, indent=1)
    return 0 if counts["fail"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
