"""Builds the C++ backend ``kaitian._C`` against the installed torch.

Install with ``pip install --no-build-isolation -e .`` so the extension links
the torch that is already in the environment.
"""

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

here = os.path.dirname(os.path.abspath(__file__))
sources = sorted(os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "cpp", "*.cpp")))

setup(
    ext_modules=[
        CppExtension(
            name="kaitian._C",
            sources=sources,
            include_dirs=[os.path.join(here, "cpp")],
            extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden"],
            extra_link_args=["-lrt"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
