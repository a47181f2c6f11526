"""The images' Dockerfiles: multi-stage where something is built, bases pinned by digest, never root."""

import os
import re

import pytest

from support import REPO

DOCKERFILES = os.path.join(REPO, "dockerfiles")
PINNED = re.compile(r"^[\w./:-]+@sha256:[0-9a-f]{64}$")
UNPINNABLE = {"mlu"}  # Cambricon's registry needs an account: the user pins it (docs/docker.md)


def _parse(target):
    """The Dockerfile's FROM references with their ARG defaults filled in, and its USER lines."""
    with open(os.path.join(DOCKERFILES, f"{target}.Dockerfile")) as f:
        lines = [line.strip() for line in f.read().replace("\\\n", " ").splitlines()]
    defaults = dict(re.match(r"ARG (\w+)=(\S*)", l).groups() for l in lines if re.match(r"ARG \w+=", l))
    froms = [re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], l.split()[1])
             for l in lines if l.startswith("FROM ")]
    users = [l.split()[1] for l in lines if l.startswith("USER ")]
    return froms, users


@pytest.mark.parametrize("target", ["cpu", "cuda", "mlu"])
def test_built_images_are_multi_stage_pinned_and_not_root(target):
    froms, users = _parse(target)
    assert len(froms) == 2, froms  # a build stage with the compilers, a runtime stage without
    for ref in froms:
        if target in UNPINNABLE:
            assert "@" not in ref  # documented as the user's to pin
        else:
            assert PINNED.match(ref), f"{target}: base {ref!r} is not pinned by digest"
    assert users and users[-1] not in ("root", "0", "0:0")


def test_cpu_host_pulls_nothing_and_is_not_root():
    froms, users = _parse("cpu-host")
    assert froms == ["scratch"]
    assert users[-1] == "65534:65534"


def test_mlu_dockerfile_says_how_to_pin_its_base():
    with open(os.path.join(DOCKERFILES, "mlu.Dockerfile")) as f:
        assert "@sha256:<digest>" in f.read()
