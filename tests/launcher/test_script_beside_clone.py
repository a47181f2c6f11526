"""A newcomer's layout: the clone in ``~/kaitian`` and their script beside it, in ``~``.

A worker's ``sys.path`` starts with the script's folder, so Python meets the
clone's folder (no ``__init__.py``) before anything else named ``kaitian``:
with the editable install's finder, which Python asks last, ``import kaitian``
gave an empty namespace package and every rank failed with "Unknown backend
type kaitian". The editable install now puts the clone's root on ``sys.path``
(pyproject.toml), where the real package wins. The script runs as the user
runs it: the installed ``kaitianrun`` and ``torchrun``, no ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from support import REPO

from kaitian.errors import UsageError
from kaitian.launcher import cli

SCRIPT = """\
import torch, torch.distributed as dist
import kaitian

dist.init_process_group("kaitian")
t = torch.full((2,), float(dist.get_rank() + 1))
dist.all_reduce(t)
print(f"rank {dist.get_rank()}: {t.tolist()} from {kaitian.__file__}", flush=True)
dist.destroy_process_group()
"""


def _home(tmp_path):
    """``tmp_path`` as the newcomer's home: a ``kaitian`` folder shaped like the clone's top, the script."""
    clone = tmp_path / "kaitian"
    clone.mkdir()
    for name in ("README.md", "Makefile", "pyproject.toml", "setup.py"):
        shutil.copy(os.path.join(REPO, name), clone)
    (tmp_path / "train.py").write_text(SCRIPT)
    return tmp_path


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAITIAN_", "PET_", "TORCHELASTIC_"))}
    env.pop("PYTHONPATH", None)  # the install alone, as for a user
    env["OMP_NUM_THREADS"] = "1"
    env["TMPDIR"] = str(tmp_path)  # torchrun's agent leaves its log folder in the temp dir
    return env


def test_a_script_beside_the_clone_trains_under_kaitianrun_and_torchrun(tmp_path):
    home = _home(tmp_path)
    bin_dir = os.path.dirname(sys.executable)
    for cmd in ([os.path.join(bin_dir, "kaitianrun"), "--nproc-per-node", "2", "--cpu-groups", "2", "train.py"],
                [os.path.join(bin_dir, "torchrun"), "--standalone", "--nproc-per-node", "2", "train.py"]):
        proc = subprocess.run(cmd, cwd=home, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{cmd[0]}:\n{out[-3000:]}"
        for rank in (0, 1):
            assert f"rank {rank}: [3.0, 3.0] from {os.path.join(REPO, 'kaitian', '__init__.py')}" in out, out


def test_a_shadowing_folder_is_refused_before_anything_starts(tmp_path, monkeypatch):
    """Were kaitian installed where a folder beside the script can shadow it (a finder, as
    setuptools' default editable install for this layout had it), kaitianrun names the folder
    (a UsageError: one line, exit status 2)."""
    home = _home(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not os.path.isfile(os.path.join(p or ".", "kaitian",
                                                                                            "__init__.py"))])
    with pytest.raises(UsageError) as err:
        cli.run(cli.build_parser().parse_args(["--nproc-per-node", "2", str(home / "train.py")]))
    assert str(err.value) == (f"{home / 'kaitian'}: this folder would be imported as `kaitian` by the workers "
                              f"instead of kaitian itself ({os.path.join(REPO, 'kaitian')}); rename it or move "
                              "the script elsewhere, or reinstall kaitian editable (make setup)")
