#!/usr/bin/env bash
# The lent GPU machine's one call (issues 34 and 35). From the repository root
# there, with the UCX kit carried in as .gpu-kit (here: cp -r ../shared/gpu-kit
# .gpu-kit; /.gpu-kit/ is in .gitignore; the device tool: carry
# [".gpu-kit"]):
#
#   bash test/gpu/run.sh
#
# probes the machine (shared/gpu-kit/probe.py), unpacks UCX, builds the
# extension with its CUDA parts for sm_90 against the machine's torch on every
# core, checks a 2-rank CPU run, probes which ways of sharing device memory
# between processes work (test/gpu/probe_sharing.py), runs the CUDA tests (test/test_cuda.py, then
# fully_shard on CUDA meshes: test/test_cuda_fsdp.py) and short CUDA
# benchmarks (benchmarks/fsdp_step.py and collectives.py, --device cuda). Each step
# has a time limit, the whole at most 8 minutes (BUDGET_S=470); a failing step does not
# stop the next (but for the build). Logs and tables go under $OUT (fetched by
# the device tool); the last lines printed are the summary.
#
# Rehearsal without a GPU (the build against another torch, the tests
# skipping), on a machine with few cores (the build's 200 s limit is sized
# for the GPU machine's 16; BUILD_LIMIT_S and BUDGET_S lift it here):
#   PY=/path/to/venv/bin/python OUT=/tmp/gpu-rehearsal BUILD_LIMIT_S=1200 \
#     BUDGET_S=1800 bash test/gpu/run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
PY=${PY:-$(command -v python3)}
KIT=${KIT:-.gpu-kit}
summary=()

# The whole at most 8 minutes: each step's limit is cut to what is left of it.
DEADLINE=$((SECONDS + ${BUDGET_S:-470}))

# step NAME LIMIT_SECONDS COMMAND...: runs it with its output in $OUT/NAME.log.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 10 ]; then
    summary+=("$name: not run (the 8-minute budget is spent)")
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local start=$SECONDS
  echo "== $name (limit ${limit} s)"
  # timeout signals its whole process group (the step's workers too), and
  # kills what outlives the TERM by 10 s: nothing of a step that ran out of
  # time shares the GPU with the next.
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$name: rc $rc in $((SECONDS - start)) s")
  tail -n 15 "$OUT/$name.log"
  return $rc
}

step probe 20 "$PY" "$KIT/probe.py"
if [ -z "$(pkg-config --modversion ucx 2>/dev/null)" ]; then
  eval "$("$KIT/unpack-ucx.sh" /tmp/fsdp-ext-ucx)"
fi
echo "pkg-config $(pkg-config --version 2>&1), ucx $(pkg-config --modversion ucx 2>&1)" | tee "$OUT/ucx.log"
export UCX_NET_DEVICES=lo UCX_TLS=self,sm,tcp UCX_LOG_LEVEL=error
# cmake and ninja: the machine's, or the venv's pip packages; nvcc: PATH's, else CUDA's usual place.
export PATH="$(dirname "$PY"):$PATH"
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
step build "${BUILD_LIMIT_S:-200}" env FSDP_EXT_CUDA=ON CUDAARCHS=90 MAX_JOBS="$(nproc)" \
  "$PY" setup.py build_ext --inplace || { printf '%s\n' "${summary[@]}"; exit 1; }
# The in-place build is importable from anywhere (torchrun's scripts, the
# tests' subprocesses, the benchmark's workers), as the Makefile's .pth does.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "from torch_fsdp_ext import _build_info as b; print({k: v for k, v in vars(b).items() if not k.startswith('_')})" \
  | tee -a "$OUT/build.log"
# torchrun's agent leaves a torchelastic_* directory in TMPDIR: a private one.
smoke_tmp=$(mktemp -d "${TMPDIR:-/tmp}/fsdp_ext_smoke_XXXXXX")
step cpu_smoke 30 env TMPDIR="$smoke_tmp" "$(dirname "$PY")/torchrun" --standalone --nproc-per-node 2 \
  test/smoke_installed.py
# Which ways of sharing device memory the IPC route finds here (legacy IPC
# handles, file descriptors), in a few seconds, before the tests use them.
step sharing_probe 40 env TMPDIR="$smoke_tmp" "$(dirname "$PY")/torchrun" --standalone \
  --nproc-per-node 2 test/gpu/probe_sharing.py
rm -rf "$smoke_tmp"
# -v: every test's name and outcome as it ends, so a log cut by the step's
# limit still says how far it got (each test's calls have a limit of their
# own, well inside the step's, after which the harness prints every rank's stacks).
step cuda_tests 150 "$PY" -m pytest -v -p no:cacheprovider -rfEs --junitxml "$OUT/cuda_tests.xml" \
  test/test_cuda.py
# fully_shard on CUDA meshes against upstream's (issue 35).
step cuda_fsdp_tests 110 "$PY" -m pytest -v -p no:cacheprovider -rfEs \
  --junitxml "$OUT/cuda_fsdp_tests.xml" test/test_cuda_fsdp.py
step cuda_fsdp_bench 70 "$PY" benchmarks/fsdp_step.py --device cuda --world-sizes 1,2 \
  --steps 9 --output "$OUT/fsdp_step_cuda.json"
step cuda_bench 40 "$PY" benchmarks/collectives.py --device cuda --world-sizes 2 \
  --min-bytes 64K --max-bytes 64M --repeats 3 --output "$OUT/collectives_cuda.json"
echo "== summary"
printf '%s\n' "${summary[@]}"
