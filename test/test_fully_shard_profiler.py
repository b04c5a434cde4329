"""FSDP phases in torch.profiler traces: ours names them as upstream does.

Both implementations train the same TinyLM (2 blocks with bf16 parameters
and fp32 outputs, so the cast ranges run too; an fp32 root) on the fsdp_ext
group under torch.profiler, and the "FSDP::" ranges of one step are counted
by name. Every range upstream records must appear in ours as often, with the
same name ("FSDP::pre_forward (layers.0)", "FSDP::backward_prefetch for
layers.0", "FSDP::post_backward_rs_wait ()", ...). Ours adds three phases
upstream has no range for (its copy-in and chunk-cat are dispatcher ops
there, and its reductions finish inside post_backward_reduce on a stream):
the all-gather copy-in, the reduce-scatter copy-in and the completion of a
reduction, each once per collective.
"""

from collections import Counter

import torch
import torch.distributed as dist

from conftest import get_pool
from fsdp_testing import IMPLS, TinyLM, fsdp_api, lm_batch, lm_loss, upstream_has

OUR_EXTRA_PHASES = ("FSDP::all_gather_copy_in", "FSDP::reduce_scatter_copy_in",
                    "FSDP::post_backward_reduce_complete")


def _fsdp_ranges(ctx, impl):
    api = fsdp_api(impl)
    torch.manual_seed(0)
    model = TinyLM(n_layers=2)
    mp = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    for layer in model.layers:
        api.fully_shard(layer, mp_policy=mp)
    api.fully_shard(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):  # the second step is profiled: lazy init is behind
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            tokens, targets = lm_batch(dist.get_rank(), step)
            lm_loss(model(tokens), targets).backward()
            optim.step()
            optim.zero_grad()
    return Counter(e.name for e in prof.events() if e.name.startswith("FSDP::"))


def test_profiler_ranges_match_upstream():
    ranges = {impl: get_pool(2).run(_fsdp_ranges, impl) for impl in IMPLS}
    for rank in range(2):
        ours, upstream = ranges["ours"][rank], ranges["upstream"][rank]
        assert upstream["FSDP::pre_forward (layers.1)"] == 1, upstream  # the reference is real
        if not upstream_has("rs_wait_profiler_range"):
            # Ours waits for the previous group's reduce-scatter under the
            # range upstream records since torch 2.12 (where the comparison
            # below covers it), once per group that has a previous one.
            waits = {name: n for name, n in ours.items()
                     if name.startswith("FSDP::post_backward_rs_wait")}
            assert waits == {"FSDP::post_backward_rs_wait ()": 1,
                             "FSDP::post_backward_rs_wait (layers.0)": 1}, waits
            ours = {name: n for name, n in ours.items() if name not in waits}
        shared = {name: n for name, n in ours.items() if not name.startswith(OUR_EXTRA_PHASES)}
        assert shared == dict(upstream), (rank, sorted(set(shared.items()) ^ set(upstream.items())))
        extras = {name: n for name, n in ours.items() if name.startswith(OUR_EXTRA_PHASES)}
        # One copy-in per all-gather (3 groups: forward, the 2 blocks again in
        # backward), one per reduce-scatter, one completion per reduction.
        assert extras == {
            "FSDP::all_gather_copy_in": 1,
            "FSDP::all_gather_copy_in (layers.0)": 2,
            "FSDP::all_gather_copy_in (layers.1)": 2,
            "FSDP::reduce_scatter_copy_in": 1,
            "FSDP::reduce_scatter_copy_in (layers.0)": 1,
            "FSDP::reduce_scatter_copy_in (layers.1)": 1,
            "FSDP::post_backward_reduce_complete": 1,
            "FSDP::post_backward_reduce_complete (layers.0)": 1,
            "FSDP::post_backward_reduce_complete (layers.1)": 1,
        }, extras
