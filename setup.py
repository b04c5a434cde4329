"""Builds torch_fsdp_ext and its C++ extension torch_fsdp_ext._C.

The extension is built by CMake (CMakeLists.txt lists its sources and flags);
build_ext below only runs CMake, in build/cmake-ext, against the torch of the
interpreter running this file. Build against the torch that is already
installed, without build isolation (an isolated build would fetch some other
torch):

    pip install --no-build-isolation .

Needs cmake (>= 3.22) and, preferably, ninja; CMakeLists.txt uses ccache when
present. MAX_JOBS caps the parallel compile jobs (default: every CPU).
"""

import os
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
CMAKE_BUILD_DIR = os.path.join(ROOT, "build", "cmake-ext")


class CMakeExtension(Extension):
    """An extension whose sources and flags live in CMakeLists.txt."""

    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        try:
            import torch.utils  # the torch this extension is for: this interpreter's
        except ImportError as error:
            raise RuntimeError(
                "install torch first, then build without build isolation: pip install --no-build-isolation ."
            ) from error

        torch_prefix = torch.utils.cmake_prefix_path
        output = os.path.abspath(self.get_ext_fullpath(ext.name))
        cmake = _tool("cmake")
        if cmake is None:
            raise RuntimeError("cmake not found; install it (Debian: apt-get install cmake, or pip install cmake)")

        configure = [
            cmake, "-S", ROOT, "-B", CMAKE_BUILD_DIR,
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_PREFIX_PATH={torch_prefix}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            "-DFSDP_EXT_BUILD_EXTENSION=ON",
            "-DFSDP_EXT_BUILD_TESTS=OFF",
            # CMake writes the module straight to where setuptools expects it.
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={os.path.dirname(output)}",
        ]
        ninja = _tool("ninja")
        if ninja:
            configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        if not self.verbose:
            configure.append("--log-level=WARNING")

        # A build directory configured for another interpreter or torch keeps
        # their paths in its cache (Torch_DIR, Python3_EXECUTABLE): start it
        # over. Configuring again with the same arguments is skipped; the
        # build step re-runs CMake itself when CMakeLists.txt changes.
        cache = os.path.join(CMAKE_BUILD_DIR, "CMakeCache.txt")
        stamp = os.path.join(CMAKE_BUILD_DIR, "setup_py_configure_args")
        if self._cache_is_for_another_torch(cache, torch_prefix):
            os.remove(cache)
        if not (os.path.exists(cache) and _read(stamp) == "\n".join(configure)):
            subprocess.check_call(configure)
            with open(stamp, "w") as f:
                f.write("\n".join(configure))

        jobs = os.environ.get("MAX_JOBS") or str(self.parallel or os.cpu_count() or 1)
        subprocess.check_call([cmake, "--build", CMAKE_BUILD_DIR, "-j", jobs])
        if not os.path.exists(output):
            raise RuntimeError(f"CMake built no {output}; see the CMake output above")

    @staticmethod
    def _cache_is_for_another_torch(cache, torch_prefix):
        wanted = {
            "Torch_DIR": os.path.realpath(os.path.join(torch_prefix, "Torch")),
            "Python3_EXECUTABLE": sys.executable,
        }
        for line in _read(cache).splitlines():
            name, _, value = line.partition(":")
            if name in wanted:
                value = value.partition("=")[2]
                if name == "Torch_DIR":
                    value = os.path.realpath(value)
                if value != wanted[name]:
                    return True
        return False


def _tool(name):
    """name on PATH, else next to the interpreter (pip's cmake and ninja in a venv not activated)."""
    return shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


setup(
    name="torch_fsdp_ext",
    version="0.1.0",
    description="fsdp_ext: a UCX-based c10d backend for CPU tensors, and FSDP2 tooling",
    packages=find_packages(include=["torch_fsdp_ext", "torch_fsdp_ext.*"]),
    ext_modules=[CMakeExtension("torch_fsdp_ext._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
)
