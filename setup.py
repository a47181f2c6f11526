"""Builds the C++ backend ``kaitian._C`` against the installed torch.

The extension must match the torch it runs with, so it is built against the
torch already in the environment: install torch first, then
``pip install --no-build-isolation -e .`` (``make setup`` does both in .venv).
Supported: torch 2.4 to 2.15 (``cpp/compat.hpp`` holds the differences).
"""

import glob
import os
import sys

from setuptools import setup

OLDEST, NEWEST = (2, 4), (2, 15)  # kaitian._torch.SUPPORTED_TORCH

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    sys.exit(
        "kaitian builds its C++ extension against the torch already installed, and none is "
        "importable here: install torch (2.4 to 2.15) first, then "
        "`pip install --no-build-isolation kaitian` (or run `make setup`)"
    )

_version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if _version < OLDEST:
    sys.exit(f"kaitian needs torch >= {OLDEST[0]}.{OLDEST[1]}; this environment has torch {torch.__version__}")
if _version > NEWEST:
    print(f"kaitian: torch {torch.__version__} is newer than the newest release tested "
          f"({NEWEST[0]}.{NEWEST[1]}); building anyway", file=sys.stderr)

# The C++ standard torch's own extension builds use: C++20 from 2.13 (2.14's
# headers refuse anything older), C++17 before.
cxx_std = "c++20" if _version >= (2, 13) else "c++17"

here = os.path.dirname(os.path.abspath(__file__))
sources = sorted(os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "cpp", "*.cpp")))

# KAITIAN_NO_EXTENSION=1: metadata and entry points only (scripts/setup.sh builds
# the extension itself with `setup.py build_ext --inplace`, incrementally).
# KAITIAN_BUILD_OPT: the optimisation flags (default "-O3 -g0": no debug info,
# which Python's own CFLAGS ask for with -g and which doubles the compile time
# against torch's headers; "-O3 -g" keeps it). CI builds the torches at the ends
# of the supported range, which prove compatibility, not speed, with "-O1 -g0".
opt = os.environ.get("KAITIAN_BUILD_OPT", "-O3 -g0").split()
# The fake accelerator uses PrivateUse1 hooks (isPinnedPtr, noexcept stream
# guards) that torch 2.4 lacks; it is built from 2.13 on (built here with 2.13
# and 2.15), and kaitian.testing.fake_accelerator says so on older torches.
FAKE_OLDEST = (2, 13)
fake = [
    # The fake accelerator (kaitian.testing.fake_accelerator): a PrivateUse1 device on host memory.
    CppExtension(
        name="kaitian.testing._fake_accelerator",
        sources=sorted(os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "cpp", "fake", "*.cpp"))),
        extra_compile_args=["-O2", "-g0", f"-std={cxx_std}", "-fvisibility=hidden"],
    ),
] if _version >= FAKE_OLDEST else []
setup(
    ext_modules=[] if os.environ.get("KAITIAN_NO_EXTENSION") == "1" else [
        CppExtension(
            name="kaitian._C",
            sources=sources,
            include_dirs=[os.path.join(here, "cpp")],
            extra_compile_args=[*opt, f"-std={cxx_std}", "-fvisibility=hidden"],
            extra_link_args=["-lrt"],
        ),
        *fake,
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
