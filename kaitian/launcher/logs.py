"""Worker logs: torchrun's redirects / tee / per-rank files, with ``[rank|group]`` console prefixes.

torch prefixes only the streams it tails, so kaitianrun tees every stream the
user did not redirect: the console shows each worker's lines prefixed with
its global rank and kaitian group (the vendor unless ``--cpu-groups``
simulates several), and every rank's output is also in
``<log-dir>/<run>/attempt_<n>/<local rank>/std{out,err}.log``. ``-r`` / ``-t``
/ ``--local-ranks-filter`` / ``--log-dir`` / ``--logs-specs`` mean exactly
what they mean for torchrun; ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` sets
the prefix (``${rank}``, ``${local_rank}``, ``${role_name}``, ``${group}``,
``${vendor}``).
"""

from __future__ import annotations

import dataclasses
import os
from string import Template
from typing import Dict, Optional, Set

from kaitian import _torch as _te

__all__ = ["DEFAULT_PREFIX_TEMPLATE", "build_logs_specs", "line_prefixes", "one_worker_logs"]

DEFAULT_PREFIX_TEMPLATE = "[${rank}|${group}]:"


def build_logs_specs(
    *,
    log_dir: str,
    redirects: str,
    tee: str,
    local_ranks_filter: Optional[Set[int]],
    nproc: int,
) -> "_te.LogsSpecs":
    """torch's ``DefaultLogsSpecs`` with every non-redirected stream tee'd.

    Args:
        log_dir: the base log directory (``--log-dir`` or the run directory's).
        redirects: ``-r`` value (``0``-``3`` or ``local_rank:mask,...``).
        tee: ``-t`` value, same format.
        local_ranks_filter: ``--local-ranks-filter`` ranks, or ``None``.
        nproc: local world size.
    """
    all_std = _te.Std.ALL
    redirect_map = _te.to_map(_te.Std.from_str(redirects), nproc)
    tee_map = _te.to_map(_te.Std.from_str(tee), nproc)
    effective_tee = {}
    for local_rank in range(nproc):
        # tee what is neither redirected nor already tee'd, so it gets a prefix
        not_redirected = _te.Std(all_std & ~redirect_map[local_rank])
        effective_tee[local_rank] = _te.Std(tee_map[local_rank] | not_redirected)
    return _te.DefaultLogsSpecs(
        log_dir=log_dir,
        redirects=redirect_map,
        tee=effective_tee,
        local_ranks_filter=local_ranks_filter,
    )


def line_prefixes(
    template: Optional[str], workers: Dict[int, Dict[str, object]]
) -> Dict[int, str]:
    """Console prefix per local rank.

    Args:
        template: ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` or ``None`` for
            kaitian's ``[rank|group]:``.
        workers: local rank -> ``rank``, ``local_rank``, ``role_name``,
            ``group``, ``vendor``.
    """
    tpl = Template(template or DEFAULT_PREFIX_TEMPLATE)
    return {local_rank: tpl.safe_substitute(**fields) for local_rank, fields in workers.items()}


def one_worker_logs(specs: "_te.LogsSpecs", local_rank: int) -> "_te.LogsSpecs":
    """``specs`` for one worker started alone (``--on-failure continue``): process 0 of its
    own process context, logged where ``specs`` puts local rank ``local_rank``
    (``attempt_<n>/<local rank>/``, ``n`` its restart count) with that rank's
    redirects, tee and filter."""
    return _OneWorkerLogs(specs, local_rank)


class _OneWorkerLogs(_te.LogsSpecs):
    def __init__(self, inner: "_te.LogsSpecs", local_rank: int) -> None:  # noqa: D107 (no base __init__: all delegated)
        self._inner = inner
        self._local_rank = local_rank

    @property
    def root_log_dir(self) -> str:
        return self._inner.root_log_dir

    def reify(self, envs):
        (env,) = envs.values()
        rank = self._local_rank
        # torch's specs number processes from 0: ask for ranks 0..rank, keep the last
        padded = {r: dict(env) for r in range(rank + 1)}
        dest = self._inner.reify(padded)
        env["TORCHELASTIC_ERROR_FILE"] = padded[rank].get("TORCHELASTIC_ERROR_FILE", "")
        for r in range(rank):  # the directories made for the ranks below are empty
            path = dest.error_files.get(r)
            if path and path != os.devnull:
                try:
                    os.rmdir(os.path.dirname(path))
                except OSError:
                    pass

        def mine(mapping):
            return {0: mapping[rank]} if rank in mapping else {}

        return dataclasses.replace(
            dest, stdouts=mine(dest.stdouts), stderrs=mine(dest.stderrs), tee_stdouts=mine(dest.tee_stdouts),
            tee_stderrs=mine(dest.tee_stderrs), error_files=mine(dest.error_files),
        )
