"""Builds torch_fsdp_ext and its C++ extension torch_fsdp_ext._C.

Build against the torch that is already installed, without build isolation
(an isolated build would fetch some other torch):

    pip install --no-build-isolation .
"""

import glob
import os
import subprocess

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def pkg_config(*args):
    try:
        out = subprocess.check_output(["pkg-config", *args, "ucx"], text=True)
    except (OSError, subprocess.CalledProcessError) as error:
        raise RuntimeError(
            "UCX not found through pkg-config; install it (Debian: apt-get install libucx-dev)"
        ) from error
    return out.split()


def flag_values(flags, prefix):
    return [f[len(prefix):] for f in flags if f.startswith(prefix)]


ucx_cflags = pkg_config("--cflags")
ucx_libs = pkg_config("--libs")
sources = sorted(
    os.path.relpath(p, ROOT)
    for p in glob.glob(os.path.join(ROOT, "csrc", "**", "*.cpp"), recursive=True)
)

extension = CppExtension(
    name="torch_fsdp_ext._C",
    sources=sources,
    include_dirs=[os.path.join(ROOT, "csrc")] + flag_values(ucx_cflags, "-I"),
    library_dirs=flag_values(ucx_libs, "-L"),
    libraries=["ucp", "ucs"],
    extra_compile_args=["-O3", "-Wall", "-Wno-unused-parameter"],
)

setup(
    name="torch_fsdp_ext",
    version="0.1.0",
    description="fsdp_ext: a UCX-based c10d backend for CPU tensors, and FSDP2 tooling",
    packages=find_packages(include=["torch_fsdp_ext", "torch_fsdp_ext.*"]),
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
)
