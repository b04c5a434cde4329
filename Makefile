# The two commands of the README: `make demo` and `make test`. Each sets up
# what a fresh Debian 12 machine lacks (UCX, a venv with torch 2.13.0 CPU,
# the build) before it runs.
SHELL := /bin/bash
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Tests and demo stay on loopback: shared memory between local ranks, TCP on lo
# (test/multihost.py sets its own: the link between its two emulated hosts).
export UCX_NET_DEVICES ?= lo
export UCX_TLS ?= self,sm,tcp
export UCX_LOG_LEVEL ?= error

.PHONY: setup system-deps cpp-deps cpp-test cpp-test-asan cpp-test-tsan venv build test test-extended compat-test torch-suite demo bench bench-report clean

setup: build

system-deps:
	@# iproute2 and util-linux (ip netns, unshare): test/multihost.py's two emulated hosts.
	@if ! command -v ip >/dev/null || ! command -v unshare >/dev/null; then \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 util-linux >/dev/null; \
	fi
	@# cmake: CMakeLists.txt builds the extension (setup.py drives it).
	@if ! pkg-config --exists ucx 2>/dev/null || ! command -v cmake >/dev/null; then \
	  echo "== installing UCX (libucx-dev) and cmake from Debian"; \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libucx-dev ucx-utils pkg-config ccache cmake >/dev/null; \
	fi

# GoogleTest (and CMake), for the C++ unit tests of the comm core.
cpp-deps: system-deps
	@if ! command -v cmake >/dev/null || ! dpkg -s libgtest-dev >/dev/null 2>&1; then \
	  echo "== installing cmake and GoogleTest (libgtest-dev) from Debian"; \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake libgtest-dev >/dev/null; \
	fi

# The torch-free comm core and its GoogleTest suite, every case, built at -O1
# without debug information and with assertions on (the build took 220 s of
# make test at -O2 -g on 2 cores; the sanitizer builds below take as long
# again each). Incremental (ccache); a few seconds once built.
cpp-test: cpp-deps
	cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-O1 >/dev/null
	cmake --build build/cmake -j2
	ctest --test-dir build/cmake --output-on-failure

# The same suite under AddressSanitizer + UndefinedBehaviorSanitizer (any
# report fails), every case (make test-extended; about 7 minutes).
cpp-test-asan: cpp-deps
	cmake -S . -B build/cmake-asan -DFSDP_EXT_SANITIZE=address,undefined >/dev/null
	cmake --build build/cmake-asan -j2
	ctest --test-dir build/cmake-asan --output-on-failure

# And under ThreadSanitizer (make test-extended; about 4.5 minutes).
# UCX's memory hooks (libucm) intercept the madvise glibc calls at thread exit
# and crash TSan's own interceptors, so they are off for this run (the tests
# allocate nothing through UCX). The algorithm matrix runs here up to 4 ranks
# (2 hosts x 2 for the pretend hosts): its 5- and 6-rank corners, the same
# threads and code paths with more peers, took 113 of TSan's 248 s; the ASan
# pass runs them. Of the one-host matrix TSan runs up to 3 ranks (4: 37 s).
cpp-test-tsan: cpp-deps
	cmake -S . -B build/cmake-tsan -DFSDP_EXT_SANITIZE=thread >/dev/null
	cmake --build build/cmake-tsan -j2
	UCX_MEM_MMAP_HOOK_MODE=none UCX_MEM_MALLOC_HOOKS=no TSAN_OPTIONS=halt_on_error=1 \
	  ctest --test-dir build/cmake-tsan --output-on-failure -E '_(5|6)ranks|OneHost/.*_4ranks'

$(VENV)/.installed:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pin torch exactly: a bare `torch` would pull the newest CUDA build.
	$(PY) -m pip install -q torch==$(TORCH_VERSION) numpy pytest ninja setuptools wheel matplotlib
	touch $@

venv: system-deps $(VENV)/.installed

# setup.py runs CMake in build/cmake-ext (Release, the extension only) and
# puts _C*.so into torch_fsdp_ext/; a few seconds when nothing changed.
build: venv
	PATH=/usr/lib/ccache:$$PATH MAX_JOBS=2 $(PY) setup.py -q build_ext --inplace
	@# Make the in-tree package importable from the venv (an editable install
	@# without pip re-running the build in a temporary directory).
	@echo "$(CURDIR)" > $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torch_fsdp_ext_dev.pth
	$(PY) -c "import torch_fsdp_ext, torch.distributed as d; assert 'fsdp_ext' in d.Backend.backend_list; print('torch_fsdp_ext built for torch', __import__('torch').__version__)"

# Test-only packages: Lightning Fabric, whose FSDP2 strategy
# test/test_framework_fabric.py trains with, expecttest, which torch's own
# test helpers import (test/torch_suite/), and torchao, whose float8 training
# and quantised weights test/test_fully_shard_extensions.py runs (the
# compatibility pass reads its pin from here). --no-deps, each dependency named,
# so that pip can never pull another torch.
# (Remade when this file changes: a new test package reaches existing venvs.)
$(VENV)/.test-deps: $(VENV)/.installed Makefile
	$(PY) -m pip install -q --no-deps lightning-fabric==2.6.6 lightning-utilities==0.15.3 fsspec==2026.9.0 expecttest==0.3.0 torchao==0.18.0
	touch $@

test: build cpp-test $(VENV)/.test-deps
	$(PY) -m pytest test -q -p no:cacheprovider -m "not extended"

# What make test leaves out, run by .ci/run after it: the comm core's suite
# under the sanitizers, and the pytest cases marked `extended` (test/conftest.py):
# end-to-end launches (torch's own suite, the examples' and a framework's
# torchrun jobs, the two emulated hosts but one job), each 15-75 s of process
# start-up on 2 cores.
test-extended: build cpp-test-asan cpp-test-tsan $(VENV)/.test-deps
	$(PY) -m pytest test -q -p no:cacheprovider -m extended

# The other ends of the supported torch range (test/compat_pass.sh): the
# extension built against PyPI's torch 2.11.0 and 2.15.0 (CUDA builds, no
# toolkit needed), each in a venv and a source copy of its own under
# build/compat/, running the pytest suite's fast core; 2.15.0 is installed
# with pip alone, its UCX from PyPI's libucx wheel. .ci/run runs it after
# `make test`.
compat-test: system-deps
	bash test/compat_pass.sh

# torch's own distributed test suite on gloo and on fsdp_ext at world sizes 2
# and 3 (test/torch_suite/compare.py): about 45 minutes on 2 cores; rewrites
# docs/torch-suite.md. `make test-extended` runs a slice of it (test/test_torch_suite.py).
torch-suite: build $(VENV)/.test-deps
	$(PY) test/torch_suite/compare.py --world-sizes 2 3

demo: build
	$(VENV)/bin/torchrun --standalone --nproc-per-node 4 examples/train_fsdp.py

bench: build $(VENV)/.test-deps
	$(PY) benchmarks/collectives.py
	$(PY) benchmarks/fsdp_step.py
	$(PY) benchmarks/ddp_step.py
	$(PY) benchmarks/qlora_step.py

# Rewrites docs/benchmarks.md (and its plots in docs/images/) from one run of
# the benchmark set (benchmarks/bench_report.py): about 15 minutes on 2 idle
# cores; root for the two emulated hosts. --quick / --render-only / --sections: see the script.
bench-report: build
	$(PY) benchmarks/bench_report.py

clean:
	rm -rf build torch_fsdp_ext/_C*.so torch_fsdp_ext/_build_info.py torch_fsdp_ext.egg-info
