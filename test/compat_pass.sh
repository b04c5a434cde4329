#!/usr/bin/env bash
# The compatibility pass (`make compat-test`, run by .ci/run after `make test`):
# the extension built and tested against the other ends of the supported torch
# range, each in a venv and a copy of the source tree of its own under
# build/compat/ (the main tree's in-place _C stays the one `make` built).
#
#   2.11.0  PyPI's CUDA build (the GPU machine's torch): built in place with
#           setup.py, against the system's UCX when there is one, with the
#           CUDA parts (FSDP_EXT_CUDA=ON where nvcc is on PATH: it compiles
#           and links them here; test/test_cuda.py then skips, as this machine
#           has no GPU);
#   2.15.0  PyPI's CUDA build, the newest torch, installed as a new user
#           without a CUDA toolkit would: a venv with only torch, `pip install --no-build-isolation .`
#           with the system's UCX ignored (FSDP_EXT_UCX=wheel: UCX then comes
#           from PyPI's libucx wheel) and no CUDA compiler used
#           (FSDP_EXT_CUDA=OFF), the source package removed from the copy so
#           that only the installed one can be imported, a 2-rank smoke run
#           (test/smoke_installed.py).
#
# Then each runs the pytest suite's fast core (COMPAT_TESTS, but the cases
# marked extended: launches of their own, the same on every torch). Neither torch
# needs a GPU or a CUDA toolkit here: the extension is CPU-only.
#
#   test/compat_pass.sh [VERSION ...]      (default: 2.11.0 2.15.0)
#
# A version from 2.14 on is installed the pip-alone way (`test/compat_pass.sh
# 2.14.1` for the one between).
#
# The middle of the range, 2.13.0 CPU, is what `make test` runs on. Machines
# that cap pip's torch (a constraints file, as on our CI machines) get the
# cap lifted for the one install of the torch under test.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
# The drop-in and API surface, training parity with upstream, the runtime
# (reset_iter_state, prefetching, ...) against upstream, bad input and
# errors, the collectives and what torch's tools expect of a backend against
# gloo, the copy kernels (their device
# implementations on host tensors: this torch's ATen ops), the CUDA files
# (collected; they skip without a GPU), the dtypes per parameter (2.15's;
# skipped on 2.11), and all-gather extensions and tensor subclass weights
# (torchao's float8, NF4, int8 and BitNet weights among them: each venv gets
# the Makefile's torchao, without dependencies as `make test` installs it).
COMPAT_TESTS=(test/test_drop_in.py test/test_fully_shard_api.py test/test_fully_shard_surface.py
              test/test_fully_shard_training.py test/test_fully_shard_runtime.py
              test/test_training.py test/test_errors.py test/test_collectives.py
              test/test_c10d_conformance.py test/test_fsdp_copy_kernels.py test/test_cuda.py
              test/test_cuda_fsdp.py test/test_fully_shard_dtypes.py
              test/test_fully_shard_extensions.py)
# The torchao the main venv has (one pin, in the Makefile's test packages).
TORCHAO_PIN=$(grep -o 'torchao==[0-9][0-9.]*' Makefile | head -n 1)
[ -n "$TORCHAO_PIN" ] || { echo "compat_pass.sh: no torchao pin in the Makefile" >&2; exit 1; }
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} UCX_TLS=${UCX_TLS:-self,sm,tcp}
export UCX_LOG_LEVEL=${UCX_LOG_LEVEL:-error}

# A venv with exactly torch==$1 (pinned: a bare torch would pull the newest).
make_venv() {
  local version=$1 venv=$2
  if [ ! -e "$venv/.torch-installed" ]; then
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q "torch==$version"
    touch "$venv/.torch-installed"
  fi
}

# A copy of the source tree (what git tracks or would track), at a fixed path
# so that ccache finds its objects again on the next run.
copy_tree() {
  local target=$1
  rm -rf "$target"
  mkdir -p "$target"
  git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
    [ -e "$f" ] && printf '%s\0' "$f"
  done | tar -C "$ROOT" --null -T - -cf - | tar -C "$target" -xf -
}

run_core_tests() {
  local venv=$1 src=$2
  "$venv/bin/python" -m pip install -q numpy pytest
  "$venv/bin/python" -m pip install -q --no-deps "$TORCHAO_PIN"
  (cd "$src" && "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not extended" \
     "${COMPAT_TESTS[@]}")
}

pass_in_place() {  # build with setup.py in the copy, as `make build` does
  local version=$1 venv=$2 src=$3
  "$venv/bin/python" -m pip install -q ninja setuptools wheel
  # The CUDA parts are required where this machine has nvcc (it does here and
  # in CI); elsewhere the pass says so and builds without them.
  local cuda=ON
  if ! command -v nvcc >/dev/null && [ -z "${CUDACXX:-}" ]; then
    cuda=AUTO
    echo "compat $version: no nvcc on PATH (nor CUDACXX): built without the CUDA parts"
  fi
  (cd "$src" && PATH=/usr/lib/ccache:$PATH MAX_JOBS=2 FSDP_EXT_CUDA=$cuda \
     "$venv/bin/python" setup.py -q build_ext --inplace)
  echo "$src" > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torch_fsdp_ext_dev.pth"
  run_core_tests "$venv" "$src"
}

pass_pip_alone() {  # a venv with only torch; pip install as a user would, no system UCX
  local version=$1 venv=$2 src=$3
  "$venv/bin/python" -m pip uninstall -q -y torch_fsdp_ext libucx-cu13 libucx-cu12 2>/dev/null || true
  (cd "$src" && PATH=/usr/lib/ccache:$PATH MAX_JOBS=2 FSDP_EXT_UCX=wheel FSDP_EXT_CUDA=OFF \
     "$venv/bin/python" -m pip install -q --no-build-isolation .)
  # Only the installed package can be imported from here on.
  rm -rf "$src/torch_fsdp_ext"
  # torchrun's agent leaves a torchelastic_* directory in TMPDIR: a private one.
  local smoke_tmp
  smoke_tmp=$(mktemp -d "${TMPDIR:-/tmp}/fsdp_ext_smoke_XXXXXX")
  (cd "$src" && TMPDIR=$smoke_tmp "$venv/bin/torchrun" --standalone --nproc-per-node 2 \
     test/smoke_installed.py) || { rm -rf "$smoke_tmp"; return 1; }
  rm -rf "$smoke_tmp"
  run_core_tests "$venv" "$src"
}

versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.11.0 2.15.0)
for version in "${versions[@]}"; do
  start=$SECONDS
  venv=$ROOT/build/compat/venv-$version
  src=$ROOT/build/compat/src-$version
  echo "== compatibility pass: torch $version"
  make_venv "$version" "$venv"
  copy_tree "$src"
  case $version in
    2.1[4-9].*) pass_pip_alone "$version" "$venv" "$src" ;;
    *) pass_in_place "$version" "$venv" "$src" ;;
  esac
  echo "== compatibility pass: torch $version passed in $((SECONDS - start)) s"
done
