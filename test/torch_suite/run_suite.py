"""torch's own distributed test suite for one backend and world size.

    BACKEND=fsdp_ext WORLD_SIZE=2 python test/torch_suite/run_suite.py [-k PATTERN] [-v]
    BACKEND=gloo     WORLD_SIZE=3 python test/torch_suite/run_suite.py --list

Runs ``DistributedTest._DistTestBase`` from the installed torch
(``torch/testing/_internal/distributed/distributed_test.py``) the way
upstream's ``test/distributed/test_distributed_spawn.py`` runs it for gloo:
one spawned process per rank for each test, a file store in TEMP_DIR.

For BACKEND=fsdp_ext the suite treats us as it treats gloo, and nothing else
changes:
  * ``fsdp_ext`` joins gloo in the suite's feature sets
    (``DistTestCases.backend_feature``) and its profiling allow-lists;
  * where a test names gloo literally (``BACKEND == "gloo"``,
    ``BACKEND != "gloo"``, ``require_backend_is_available({"gloo", ...})``),
    the comparison is widened to ``("gloo", "fsdp_ext")``. The rewrite works
    on the suite's syntax tree, compiled under torch's own file name, so a
    traceback points at torch's lines.

Tests whose GPU or world-size decorator would skip them in every spawned
rank on this machine (no GPU; fewer than 8 ranks) are skipped before
spawning, with the decorator's reason, for both backends alike: they would
spend seconds each on process start-up to report the same skip.

Run as a script: each spawned rank re-executes this file (start method
spawn), so the registration and the rewrite happen in every rank.
"""

import ast
import importlib.util
import os
import sys
import tempfile
import unittest

# torch's test helpers read CI=true as "upstream's CI": they then write JUnit
# XML through xmlrunner (not installed) and change some skips. Our CI runs
# the suite as a developer would.
os.environ.pop("CI", None)
BACKEND = os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
if "TEMP_DIR" not in os.environ:
    # As upstream's run_test.py: a directory with barrier/ and test_dir/.
    # Children inherit it through the environment.
    _temp = tempfile.mkdtemp(prefix="torch_suite_")
    os.mkdir(os.path.join(_temp, "barrier"))
    os.mkdir(os.path.join(_temp, "test_dir"))
    os.environ["TEMP_DIR"] = _temp

import torch  # noqa: E402

SUITE = "torch.testing._internal.distributed.distributed_test"
GLOO_ALIKE = "fsdp_ext"


class _TreatAsGloo(ast.NodeTransformer):
    """Widens the suite's literal gloo checks to include fsdp_ext."""

    def __init__(self):
        self.rewritten = 0

    def visit_Compare(self, node):
        self.generic_visit(node)
        names_backend = isinstance(node.left, ast.Name) and node.left.id == "BACKEND"
        if (names_backend and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.NotEq))
                and isinstance(node.comparators[0], ast.Constant)
                and node.comparators[0].value == "gloo"):
            self.rewritten += 1
            membership = ast.In() if isinstance(node.ops[0], ast.Eq) else ast.NotIn()
            both = ast.Tuple([ast.Constant("gloo"), ast.Constant(GLOO_ALIKE)], ast.Load())
            return ast.copy_location(ast.Compare(node.left, [membership], [both]), node)
        return node

    def visit_Call(self, node):
        self.generic_visit(node)
        if (isinstance(node.func, ast.Name) and node.func.id == "require_backend_is_available"
                and node.args and isinstance(node.args[0], ast.Set)
                and any(isinstance(e, ast.Constant) and e.value == "gloo"
                        for e in node.args[0].elts)):
            self.rewritten += 1
            node.args[0].elts.append(ast.copy_location(ast.Constant(GLOO_ALIKE), node))
        return node


def _load_suite_as_gloo_alike():
    import torch_fsdp_ext  # noqa: F401  (the suite's decorators look the backend up at import)
    from torch.testing._internal.common_distributed import DistTestCases

    for feature in ("gpu", "cuda", "ddp", "subgroup", "plugin"):
        if "gloo" in DistTestCases.backend_feature.get(feature, ()) or feature == "plugin":
            DistTestCases.backend_feature[feature].add(GLOO_ALIKE)
    spec = importlib.util.find_spec(SUITE)
    with open(spec.origin) as source:
        tree = ast.parse(source.read(), spec.origin)
    transformer = _TreatAsGloo()
    tree = ast.fix_missing_locations(transformer.visit(tree))
    if transformer.rewritten == 0:
        raise RuntimeError(f"{SUITE}: no literal gloo check found to widen; has the suite changed?")
    module = importlib.util.module_from_spec(spec)
    sys.modules[SUITE] = module
    exec(compile(tree, spec.origin, "exec"), module.__dict__)
    for allow_list in ("PROFILING_SUPPORTED_BACKENDS", "CUDA_PROFILING_SUPPORTED_BACKENDS",
                       "SEND_RECV_PROFILING_SUPPORTED_BACKENDS"):
        names = getattr(module, allow_list, None)
        if names is not None and "gloo" in names:
            names.append(GLOO_ALIKE)
    return transformer.rewritten


REWRITTEN = _load_suite_as_gloo_alike() if BACKEND == GLOO_ALIKE else 0

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


def _decorator_skip(test):
    """The skip a GPU or world-size decorator would make in every rank here,
    or None. Decorators are found by their wrappers' code names (functools.
    wraps copies the test's name onto the wrapper, not onto its code)."""
    world_size = int(os.environ["WORLD_SIZE"])
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    fn = test
    while fn is not None:
        code = getattr(fn, "__code__", None)
        qualname = code.co_qualname if code is not None else ""
        closure = {}
        if code is not None and fn.__closure__:
            closure = {name: cell.cell_contents
                       for name, cell in zip(code.co_freevars, fn.__closure__)}
        if qualname.startswith("skip_if_no_gpu.") and gpus == 0:
            return "needs a GPU (skip_if_no_gpu)"
        if (qualname.startswith("skip_if_lt_x_gpu.") and gpus < closure.get("x", 1)
                and not closure.get("allow_cpu", False)):
            return f"needs {closure.get('x')} GPUs (skip_if_lt_x_gpu)"
        if qualname.startswith("skip_if_small_worldsize.") and world_size < 8:
            return "needs world size >= 8 (skip_if_small_worldsize)"
        fn = getattr(fn, "__wrapped__", None)
    return None


def _record(test_name, outcome, detail):
    """One JSON line per test in $TORCH_SUITE_RESULTS (compare.py reads them)."""
    path = os.environ.get("TORCH_SUITE_RESULTS")
    if path:
        import json

        with open(path, "a") as out:
            out.write(json.dumps({"test": test_name, "outcome": outcome,
                                  "detail": detail[-3000:]}) + "\n")


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def run(self, result=None):
        result = result if result is not None else self.defaultTestResult()
        counts = (len(result.failures), len(result.errors), len(result.skipped))
        super().run(result)
        if len(result.failures) > counts[0]:
            _record(self._testMethodName, "failed", result.failures[-1][1])
        elif len(result.errors) > counts[1]:
            _record(self._testMethodName, "failed", result.errors[-1][1])
        elif len(result.skipped) > counts[2]:
            _record(self._testMethodName, "skipped", result.skipped[-1][1])
        else:
            _record(self._testMethodName, "passed", "")
        return result

    def setUp(self):
        reason = _decorator_skip(getattr(type(self), self._testMethodName))
        if reason:
            raise unittest.SkipTest(reason)
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


# One name in the parent and in every rank (the rank unpickles the class by
# name); the backend in it keeps the two runs apart in reports.
_NAME = f"TestDistBackendWithSpawn_{BACKEND}"
TestDistBackendWithSpawn.__name__ = TestDistBackendWithSpawn.__qualname__ = _NAME
globals()[_NAME] = TestDistBackendWithSpawn
del TestDistBackendWithSpawn

if __name__ == "__main__":
    if "--list" in sys.argv:
        cls = globals()[_NAME]
        names = sorted(n for n in dir(cls) if n.startswith("test"))
        for name in names:
            method = getattr(cls, name)
            reason = (getattr(method, "__unittest_skip_why__", None)
                      if getattr(method, "__unittest_skip__", False) else _decorator_skip(method))
            print(name, "skip: " + reason if reason else "run")
        sys.exit(0)
    if BACKEND == GLOO_ALIKE:
        print(f"run_suite: {REWRITTEN} literal gloo checks widened to fsdp_ext", flush=True)
    run_tests()
