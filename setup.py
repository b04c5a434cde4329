"""Builds torch_fsdp_ext and its C++ extension torch_fsdp_ext._C.

The extension is built by CMake (CMakeLists.txt lists its sources and flags);
build_ext below only runs CMake, in build/cmake-ext, against the torch of the
interpreter running this file. Build against the torch that is already
installed, without build isolation (an isolated build would fetch some other
torch):

    pip install --no-build-isolation .

Needs cmake (>= 3.22) and, preferably, ninja; CMakeLists.txt uses ccache when
present. MAX_JOBS caps the parallel compile jobs (default: every CPU).

UCX: the system's when pkg-config finds one (it may have InfiniBand), else
PyPI's libucx wheel (libucx-cu13; libucx-cu12 for a torch built with CUDA 12),
which is also a dependency of the package: the one installed in this
environment, or, where none is yet (pip installs dependencies after building),
the wheel fetched into build/ for its headers. FSDP_EXT_UCX=system or =wheel
insists on one (cmake/ucx.cmake).

CUDA: the CUDA parts are built when torch is a CUDA build and CMake finds a
CUDA compiler (nvcc on PATH); FSDP_EXT_CUDA=ON requires them, =OFF leaves them
out (cmake/cuda.cmake; CUDAARCHS picks the GPU architectures, default 90).
"""

import glob
import os
import shutil
import subprocess
import sys
import zipfile

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
CMAKE_BUILD_DIR = os.path.join(ROOT, "build", "cmake-ext")
# What CMake writes beside _C (CMakeLists.txt).
BUILD_INFO = "_build_info.py"
# The libucx wheel version fetched for a build when none is installed; the
# package then requires at least it (UCX's ABI holds for newer libraries).
UCX_WHEEL_VERSION = "1.22.0"


class CMakeExtension(Extension):
    """An extension whose sources and flags live in CMakeLists.txt."""

    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        try:
            import torch  # the torch this extension is for: this interpreter's
        except ImportError as error:
            raise RuntimeError(
                "install torch first, then build without build isolation: pip install --no-build-isolation ."
            ) from error

        output = os.path.abspath(self.get_ext_fullpath(ext.name))
        cmake = _tool("cmake")
        if cmake is None:
            raise RuntimeError("cmake not found; install it (Debian: apt-get install cmake, or pip install cmake)")

        configure = [
            cmake, "-S", ROOT, "-B", CMAKE_BUILD_DIR,
            "-DCMAKE_BUILD_TYPE=Release",
            # The torch to build against is this interpreter's (cmake/torch.cmake).
            f"-DPython3_EXECUTABLE={sys.executable}",
            "-DFSDP_EXT_BUILD_EXTENSION=ON",
            "-DFSDP_EXT_BUILD_TESTS=OFF",
            *_ucx_cmake_arguments(),
            # FSDP_EXT_CUDA=AUTO|ON|OFF: the CUDA parts (cmake/cuda.cmake).
            f"-DFSDP_EXT_CUDA={os.environ.get('FSDP_EXT_CUDA', 'AUTO')}",
            # CMake writes the module straight to where setuptools expects it.
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={os.path.dirname(output)}",
        ]
        ninja = _tool("ninja")
        if ninja:
            configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        if not self.verbose:
            configure.append("--log-level=WARNING")

        # A build directory configured for another interpreter, torch or UCX
        # keeps their paths in its cache: start it over. Configuring again
        # with the same arguments and torch is skipped; the build step re-runs
        # CMake itself when CMakeLists.txt changes.
        cache = os.path.join(CMAKE_BUILD_DIR, "CMakeCache.txt")
        stamp = os.path.join(CMAKE_BUILD_DIR, "setup_py_configure_args")
        wanted = "\n".join(configure + [f"torch {torch.__version__} in {torch.__file__}"])
        if _read(stamp) != wanted:
            if os.path.exists(cache):
                os.remove(cache)
            subprocess.check_call(configure)
            with open(stamp, "w") as f:
                f.write(wanted)

        jobs = os.environ.get("MAX_JOBS") or str(self.parallel or os.cpu_count() or 1)
        subprocess.check_call([cmake, "--build", CMAKE_BUILD_DIR, "-j", jobs])
        if not os.path.exists(output):
            raise RuntimeError(f"CMake built no {output}; see the CMake output above")

    def copy_extensions_to_source(self):
        """An in-place build (build_ext --inplace, `make build`) copies _C into
        the source package; _build_info.py, which CMake writes beside _C (what
        it was built against, read before _C loads), goes with it."""
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace_file, regular_file = self._get_inplace_equivalent(build_py, ext)
            info = os.path.join(os.path.dirname(regular_file), BUILD_INFO)
            self.copy_file(info, os.path.join(os.path.dirname(inplace_file), BUILD_INFO),
                           level=self.verbose)


def _libucx_package():
    """libucx-cu13, or -cu12 for a torch built with CUDA 12 (the wheel's CUDA
    transports load against that CUDA; a CPU torch takes cu13's)."""
    try:
        import torch

        cuda = torch.version.cuda or ""
    except ImportError:
        cuda = ""
    return "libucx-cu12" if cuda.startswith("12.") else "libucx-cu13"


def _ucx_cmake_arguments():
    """The CMake arguments that pick UCX (see the module docstring)."""
    choice = os.environ.get("FSDP_EXT_UCX", "auto").lower()
    if choice not in ("auto", "system", "wheel"):
        raise RuntimeError(f"FSDP_EXT_UCX={choice!r}: expected auto, system or wheel")
    if choice != "wheel" and subprocess.call(["pkg-config", "--exists", "ucx"],
                                             stderr=subprocess.DEVNULL) == 0:
        return ["-DFSDP_EXT_UCX=SYSTEM"]
    if choice == "system":
        raise RuntimeError("FSDP_EXT_UCX=system but pkg-config finds no ucx (Debian: apt-get install libucx-dev)")
    return ["-DFSDP_EXT_UCX=WHEEL", f"-DFSDP_EXT_UCX_WHEEL_DIR={_libucx_directory()}"]


def _libucx_directory():
    """The libucx package this environment has, else the wheel fetched and
    unpacked into build/ (its headers and libraries are what the build needs;
    pip installs the same wheel as a dependency afterwards)."""
    try:
        import libucx

        return os.path.dirname(os.path.realpath(libucx.__file__))
    except ImportError:
        pass
    package = _libucx_package()
    target = os.path.join(ROOT, "build", f"{package}-{UCX_WHEEL_VERSION}")
    directory = os.path.join(target, "libucx")
    if not os.path.exists(os.path.join(directory, "lib", "cmake", "ucx")):
        print(f"== fetching {package}=={UCX_WHEEL_VERSION} for its UCX headers and libraries", flush=True)
        download = os.path.join(target, "download")
        subprocess.check_call([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                               "--only-binary", ":all:", "-d", download,
                               f"{package}=={UCX_WHEEL_VERSION}"])
        (wheel,) = glob.glob(os.path.join(download, "*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
    return directory


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
    # torch is not listed: a requirement on it could make pip fetch another
    # torch than the one this extension is built against.
    install_requires=[f"{_libucx_package()}>={UCX_WHEEL_VERSION}"],
)
