"""torch's distributed suite on gloo and on fsdp_ext, side by side.

    python test/torch_suite/compare.py [--world-sizes 2 3] [--report docs/torch-suite.md]

Runs run_suite.py once per backend and world size (each test in freshly
spawned ranks, as upstream runs it for gloo), then writes a report: passed,
failed and skipped per backend, and every test that passes on gloo but not
on fsdp_ext, each either a listed exception (a test torch's own code refuses
to any backend not named gloo, with the torch line that does it) or an
unexplained failure. Exits 1 when there is an unexplained one.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BACKENDS = ("gloo", "fsdp_ext")

# Tests torch's own code refuses to every backend not named gloo: the
# refusal is in torch, not in the backend under test. Each names the torch
# file and a line of it, found in the installed torch when the report is made.
MONITORED_BARRIER = (
    "distributed/distributed_c10d.py",
    'raise ValueError("monitored_barrier is only implemented for GLOO backend.")',
    "`dist.monitored_barrier` refuses every backend not named gloo; fsdp_ext offers the same "
    "barrier as `torch_fsdp_ext.monitored_barrier`.",
)
EXCEPTIONS = {
    "test_monitored_barrier_gloo": MONITORED_BARRIER,
    "test_monitored_barrier_gloo_subgroup": MONITORED_BARRIER,
    "test_ddp_logging_data_cpu": (
        "include/torch/csrc/distributed/c10d/ProcessGroup.hpp",
        "return backendTypeToString(backendType_);",
        "DDP logs `ProcessGroup::getBackendName()`, the name of the group's backend type, which "
        "is `\"custom\"` for every backend registered with `Backend.register_backend`; the test "
        "expects `dist.get_backend(group)`, `\"fsdp_ext\"`.",
    ),
}


def torch_line(relative_path, needle):
    """`relative_path:line` of `needle` in the installed torch ("" if absent)."""
    import torch

    path = os.path.join(os.path.dirname(torch.__file__), relative_path)
    try:
        with open(path) as source:
            for number, line in enumerate(source, 1):
                if needle in line:
                    return f"torch/{relative_path}:{number}"
    except OSError:
        pass
    return ""


def exception_reason(test):
    if test not in EXCEPTIONS:
        return None
    relative_path, needle, why = EXCEPTIONS[test]
    where = torch_line(relative_path, needle) or f"torch/{relative_path}"
    return f"{why} (`{where}`: `{needle}`)"


def run_one(backend, world_size, results_dir):
    path = os.path.join(results_dir, f"{backend}_ws{world_size}.jsonl")
    if os.path.exists(path):
        os.remove(path)
    env = dict(os.environ, BACKEND=backend, WORLD_SIZE=str(world_size),
               TORCH_SUITE_RESULTS=path)
    env.pop("TEMP_DIR", None)
    env.setdefault("UCX_NET_DEVICES", "lo")
    env.setdefault("UCX_TLS", "self,sm,tcp")
    env.setdefault("UCX_LOG_LEVEL", "error")
    log = os.path.join(results_dir, f"{backend}_ws{world_size}.log")
    start = time.monotonic()
    with open(log, "w") as out:
        subprocess.run([sys.executable, os.path.join(HERE, "run_suite.py"), "-v"],
                       env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    elapsed = time.monotonic() - start
    with open(os.path.join(results_dir, f"{backend}_ws{world_size}.seconds"), "w") as out:
        out.write(f"{elapsed:.0f}\n")
    return load_one(backend, world_size, results_dir, elapsed, log)


def load_one(backend, world_size, results_dir, elapsed=None, log=None):
    """A run's outcomes per test, and how long it took."""
    path = os.path.join(results_dir, f"{backend}_ws{world_size}.jsonl")
    log = log or os.path.join(results_dir, f"{backend}_ws{world_size}.log")
    if elapsed is None:
        with open(os.path.join(results_dir, f"{backend}_ws{world_size}.seconds")) as seconds:
            elapsed = float(seconds.read())
    outcomes = {}
    if os.path.exists(path):
        with open(path) as lines:
            for line in lines:
                entry = json.loads(line)
                outcomes[entry["test"]] = entry
    print(f"== {backend} at world size {world_size}: {len(outcomes)} tests in {elapsed:.0f} s "
          f"(log {os.path.relpath(log, ROOT)})", flush=True)
    return outcomes, elapsed


def first_line(detail):
    """The line of a failure's text that says what failed: the last error line."""
    lines = [line.strip() for line in detail.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or [""])[-1][:200]


def summarise(world_size, runs):
    gloo, ours = runs["gloo"][0], runs["fsdp_ext"][0]
    counts = {}
    for backend, (outcomes, elapsed) in runs.items():
        tally = {"passed": 0, "failed": 0, "skipped": 0}
        for entry in outcomes.values():
            tally[entry["outcome"]] += 1
        counts[backend] = (tally, elapsed)
    behind = []
    for test, entry in sorted(gloo.items()):
        if entry["outcome"] != "passed":
            continue
        mine = ours.get(test, {"outcome": "missing", "detail": ""})
        if mine["outcome"] != "passed":
            behind.append((test, mine["outcome"], first_line(mine["detail"]),
                           exception_reason(test)))
    ahead = sorted(t for t, e in ours.items()
                   if e["outcome"] == "passed" and gloo.get(t, {}).get("outcome") != "passed")
    return counts, behind, ahead


def render(sections, commit, started, command):
    lines = [
        "# torch's distributed test suite on fsdp_ext",
        "",
        "torch ships the test suite it holds its own backends to",
        "(`torch.testing._internal.distributed.distributed_test`, `DistributedTest._DistTestBase`).",
        "We run it for gloo and for fsdp_ext on the same machine, the way upstream runs it for",
        "gloo: every test in freshly spawned ranks, a file store. fsdp_ext is treated as the",
        "suite treats gloo (the same feature sets, and gloo's branches where a test names gloo);",
        "nothing else is changed. Tests that need a GPU or 8 ranks are skipped on this machine",
        "for both backends alike.",
        "",
        f"Last run: {started} on commit `{commit}`, torch {torch_version()}, "
        f"{os.cpu_count()} cores ({platform.machine()}), with `{command}`.",
        "",
    ]
    for world_size, (counts, behind, ahead) in sections:
        lines += [f"## World size {world_size}", "",
                  "| backend | passed | failed | skipped | time |", "|---|---|---|---|---|"]
        for backend in BACKENDS:
            tally, elapsed = counts[backend]
            lines.append(f"| {backend} | {tally['passed']} | {tally['failed']} | "
                         f"{tally['skipped']} | {elapsed:.0f} s |")
        lines.append("")
        if behind:
            lines += ["Tests that pass on gloo but not on fsdp_ext:", "",
                      "| test | fsdp_ext | why |", "|---|---|---|"]
            for test, outcome, detail, reason in behind:
                why = f"torch refuses it: {reason}" if reason else f"**not explained**: `{detail}`"
                lines.append(f"| `{test}` | {outcome} | {why} |")
        else:
            lines.append("Every test that passes on gloo passes on fsdp_ext.")
        if ahead:
            lines += ["", "Passing on fsdp_ext but not on gloo: " +
                      ", ".join(f"`{t}`" for t in ahead) + "."]
        lines.append("")
    return "\n".join(lines)


def torch_version():
    import torch

    return torch.__version__


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--report", default=os.path.join(ROOT, "docs", "torch-suite.md"))
    parser.add_argument("--results", default=os.path.join(ROOT, "build", "torch_suite"))
    parser.add_argument("--report-only", action="store_true",
                        help="write the report from the last run's results, running nothing")
    args = parser.parse_args()
    os.makedirs(args.results, exist_ok=True)
    started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    if args.report_only:
        stamp = os.path.getmtime(os.path.join(args.results, f"gloo_ws{args.world_sizes[0]}.jsonl"))
        started = datetime.datetime.fromtimestamp(stamp).strftime("%Y-%m-%d %H:%M")
    commit_file = os.path.join(args.results, "commit")
    if args.report_only:
        with open(commit_file) as text:
            commit = text.read().strip()
    else:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip() or "unknown"
        with open(commit_file, "w") as out:
            out.write(commit + "\n")
    sections = []
    unexplained = 0
    for world_size in args.world_sizes:
        load = load_one if args.report_only else run_one
        runs = {backend: load(backend, world_size, args.results) for backend in BACKENDS}
        counts, behind, ahead = summarise(world_size, runs)
        sections.append((world_size, (counts, behind, ahead)))
        unexplained += sum(1 for *_, reason in behind if reason is None)
    command = "make torch-suite"
    report = render(sections, commit, started, command)
    with open(args.report, "w") as out:
        out.write(report)
    print(report)
    if unexplained:
        print(f"{unexplained} test(s) pass on gloo but not on fsdp_ext without a listed reason")
        sys.exit(1)


if __name__ == "__main__":
    main()
