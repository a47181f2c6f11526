"""The run-dir base ``$TMPDIR/kaitian-<uid>`` is checked without following links
and refused, never chmodded, when it is not ours (issue 20)."""

from __future__ import annotations

import os

import pytest

from kaitian.errors import RunDirError
from kaitian.launcher import rundir


@pytest.fixture
def tmpdir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(rundir.tempfile, "tempdir", None)  # re-read TMPDIR
    return tmp_path


def test_base_dir_created_owner_only(tmpdir_env):
    path = rundir.base_dir()
    st = os.lstat(path)
    assert path == str(tmpdir_env / f"kaitian-{os.getuid()}")
    assert st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o700


def test_planted_symlink_is_refused_and_its_target_untouched(tmpdir_env):
    victim = tmpdir_env / "victim-shared"
    victim.mkdir(mode=0o755)
    os.chmod(victim, 0o755)
    os.symlink(victim, tmpdir_env / f"kaitian-{os.getuid()}")
    with pytest.raises(RunDirError, match="not a directory.*symbolic link|symbolic link"):
        rundir.base_dir()
    assert os.stat(victim).st_mode & 0o777 == 0o755


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to hand a directory to another uid")
def test_base_owned_by_another_user_is_refused_not_chmodded(tmpdir_env):
    base = tmpdir_env / f"kaitian-{os.getuid()}"
    base.mkdir()
    os.chmod(base, 0o777)
    os.chown(base, 65534, 65534)
    with pytest.raises(RunDirError, match="belongs to uid 65534"):
        rundir.base_dir()
    assert os.lstat(base).st_mode & 0o777 == 0o777


def test_our_loose_base_is_tightened(tmpdir_env):
    base = tmpdir_env / f"kaitian-{os.getuid()}"
    base.mkdir()
    os.chmod(base, 0o777)
    rundir.base_dir()
    assert os.lstat(base).st_mode & 0o777 == 0o700
