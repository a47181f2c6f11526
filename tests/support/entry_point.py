"""kaitian's ``torchrun.handlers`` entry point, declared the way an install declares it."""

from __future__ import annotations

import os

from support import REPO

__all__ = ["entry_point_site"]


def entry_point_site(tmp_path) -> str:
    """A site directory whose dist-info declares pyproject's ``torchrun.handlers`` entry point.

    Put it on ``PYTHONPATH`` and torch's own plug-in loader imports kaitian's
    rendezvous while torchrun starts, as after ``pip install kaitian``.
    """
    text = open(os.path.join(REPO, "pyproject.toml")).read()
    line = text.split('[project.entry-points."torchrun.handlers"]', 1)[1].strip().splitlines()[0]
    name, _, value = (part.strip().strip('"') for part in line.partition("="))
    dist_info = tmp_path / "site" / "kaitian_entry_point-0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: kaitian-entry-point\nVersion: 0\n")
    (dist_info / "entry_points.txt").write_text(f"[torchrun.handlers]\n{name} = {value}\n")
    return str(tmp_path / "site")
