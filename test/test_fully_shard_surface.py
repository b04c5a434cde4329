"""The rest of the FSDPModule surface, ours next to upstream's fully_shard in
the same processes on the same backend: all-reduce hooks, custom comms,
SUM-only reductions, unused parameters, reduce-scatter buffer caps,
share_comm_ctx, tied and frozen parameters, grouped modules called on their
own (chunked loss), GradScaler with fp16, and distributed checkpoints saved
at one world size and loaded at another.

Where the two implementations run the same arithmetic, losses and final
parameters must be equal bit for bit and the communication counts the same.
"""

import warnings
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from conftest import get_pool
from fsdp_testing import IMPLS, TinyLM, fsdp_api, lm_batch, lm_loss, requires_upstream, upstream_has
from test_fully_shard_configs import make_mesh

STEPS = 4
RS = "c10d._reduce_scatter_base_"
AG = "c10d._allgather_base_"


# --------------------------------------------------------------------------
# Models


class TwoBranch(nn.Module):
    """Even ranks run branch `a`, odd ranks branch `b`: without
    reduce_scatter_unused_params the ranks would issue different collectives."""

    def __init__(self, dim=8):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, rank):
        h = F.relu(self.inp(x))
        h = self.a(h) if rank % 2 == 0 else self.b(h)
        return self.out(F.relu(h))


class TiedLM(nn.Module):
    """An embedding whose weight is also the output projection's."""

    def __init__(self, vocab=32, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.norm(self.body(self.embed(tokens)))


class PartlyFrozen(nn.Sequential):
    """Blocks whose biases (and one whole block) do not train."""

    def __init__(self, dim=12):
        super().__init__(*[nn.Linear(dim, dim) for _ in range(4)])
        for i, layer in enumerate(self):
            layer.bias.requires_grad_(False)
            if i == 1:
                layer.weight.requires_grad_(False)


def _x(rank, step, shape=(4, 8)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 * step + rank))


# --------------------------------------------------------------------------
# Side-by-side training with a per-case set-up


class CollectiveCounter:
    """Counts c10d collectives like CommDebugMode ("c10d._allgather_base_"
    ...) without its module tracker, which expects every module call to
    happen inside one root forward (a head called per chunk is not)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = Counter()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace == "c10d":
                    counts[f"c10d.{func._opname}"] += 1
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


class HookRecorder:
    """An all-reduce hook that scales in place (so a missing call changes
    the numbers), counts its calls and notes which CPU stream was current:
    the one given to set_all_reduce_hook, the default one, or another (the
    FSDP group's own)."""

    def __init__(self, stream=None):
        self.calls = 0
        self.streams = set()
        self._given = stream
        self._default = torch.cpu.current_stream()

    def __call__(self, output):
        self.calls += 1
        current = torch.cpu.current_stream()
        self.streams.add("given" if current is self._given and current is not None
                         else "default" if current is self._default else "the group's own")
        output.mul_(0.5)


class CountingAllGather:
    """Upstream's AllGather Comm protocol, delegating to torch.distributed."""

    def __init__(self):
        self.calls = self.allocs = 0

    def allocate(self, size, *, dtype, device):
        self.allocs += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                           async_op=async_op)


class CountingReduceScatter(CountingAllGather):
    """Upstream's ReduceScatter Comm protocol. Records the ops it was given."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        self.ops.add(str(op))
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                          async_op=async_op)


def _grouped_head_lm(api, mesh):
    """An LM whose forward ends at the norm, with fully_shard([norm, head])
    (the head untied from the embedding): the loss applies the head itself."""
    model = TiedLM()
    model.head.weight = nn.Parameter(model.head.weight.detach().clone())
    for layer in (model.body[0], model.body[2]):
        api.fully_shard(layer, mesh=mesh)
    api.fully_shard([model.norm, model.head], mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    return model


def _shard_blocks_with_experts(model, api, mesh, expert_info, is_expert):
    """fully_shard each block of a TinyLM with the parameters `is_expert`
    picks on `expert_info`'s mesh (ShardPlacementResult), the rest on `mesh`,
    then the root; returns the number of parameter groups per block."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.tensor import Shard

    def placement(param):
        return ShardPlacementResult(Shard(0), expert_info) if is_expert(param) else None

    for block in model.layers:
        api.fully_shard(block, mesh=mesh, shard_placement_fn=placement)
    api.fully_shard(model, mesh=mesh)
    return [len(block._get_fsdp_state()._fsdp_param_groups) for block in model.layers]


def _shard_experts_on_their_mesh(model, api, mesh, expert_info, extra):
    """fully_shard for the per-parameter-mesh cases over a TinyLM whose
    feed-forwards hold DTensor parameters: those go to `expert_info`'s mesh,
    the rest to `mesh`; the ranks of a TP pair ({0, 1}, {2, 3}) see the same
    batch."""
    from torch.distributed.tensor import DTensor

    extra["groups_per_block"] = _shard_blocks_with_experts(
        model, api, mesh, expert_info, lambda param: isinstance(param, DTensor))

    def same_batch_per_tp_pair(m, r, s):
        tokens, targets = lm_batch(r // 2, s)
        return lm_loss(m(tokens), targets)

    return model, same_batch_per_tp_pair, extra


def _build(case, api, mesh):
    """(model, loss_fn(model, rank, step), state to report) for `case`."""
    extra = {}
    if case == "unused_params":
        model = TwoBranch()
        api.fully_shard(model.inp, mesh=mesh)
        api.fully_shard(model.out, mesh=mesh)
        api.fully_shard(model, mesh=mesh)  # both branches in one group
        model.set_reduce_scatter_unused_params(True)
        return model, lambda m, r, s: m(_x(r, s), r).pow(2).mean(), extra
    if case == "chunked_head":
        model = _grouped_head_lm(api, mesh)

        def chunked(m, r, s):
            tokens, targets = lm_batch(r, s, batch=4)
            hidden = m(tokens)
            # The head is skipped by forward and applied per chunk.
            return sum(lm_loss(m.head(h).flatten(0, 1), t)
                       for h, t in zip(hidden.chunk(2), targets.chunk(2)))

        return model, chunked, extra
    if case == "grouped_head_after_backward":
        model = _grouped_head_lm(api, mesh)

        def head_again(m, r, s):
            tokens, targets = lm_batch(r, s, batch=4)
            lm_loss(m.head(m(tokens)).flatten(0, 1), targets).backward()
            # After that backward has finished: the grouped head on its own,
            # the only module of its group to run (no pre-backward hook), and
            # a second backward whose gradients must reach the head too.
            h = torch.randn(3, 16, generator=torch.Generator().manual_seed(10 * s + r))
            return m.head(h.requires_grad_()).pow(2).mean()

        return model, head_again, extra
    if case == "per_param_mesh":
        # Dense parameters sharded over all 4 ranks (fully_shard's 1-D mesh);
        # each block's feed-forward, standing for an expert, on its own 2x2
        # HSDP mesh through ShardPlacementResult: two groups per block.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

        expert_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        expert_info = HSDPMeshInfo(expert_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
        model = TinyLM()
        experts = {id(p) for block in model.layers for p in block.feed_forward.parameters()}
        extra["groups_per_block"] = _shard_blocks_with_experts(
            model, api, mesh, expert_info, lambda param: id(param) in experts)
        return model, lambda m, r, s: lm_loss(m(lm_batch(r, s)[0]), lm_batch(r, s)[1]), extra
    if case == "spmd_per_param_mesh":
        # As tp_per_param_mesh, with the feed-forwards on the full (efsdp,
        # tp) SPMD mesh (replicated over efsdp, TP over tp) and their
        # per-parameter mesh given with dp_mesh_dims, as torchtitan shards
        # experts; the other parameters plain, over all 4 ranks.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import DataParallelMeshDims
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
        from torch.distributed.tensor import (
            DTensor,
            Replicate,
            Shard,
            distribute_module,
            distribute_tensor,
        )

        # Dim names of this implementation's own: DTensor caches specs by
        # equal meshes, and upstream checks the parameters' mesh by identity.
        efsdp = f"efsdp_{api.name}"
        spmd = init_device_mesh("cpu", (2, 2), mesh_dim_names=(efsdp, f"etp_{api.name}"))
        expert_info = FSDPMeshInfo(spmd[efsdp], shard_mesh_dim=0,
                                   dp_mesh_dims=DataParallelMeshDims(shard=efsdp),
                                   spmd_mesh=spmd)

        def partition(name, module, device_mesh):
            for pname, param in list(module.named_parameters(recurse=False)):
                tp = Replicate()
                if name == "w1":
                    tp = Shard(0)
                elif name == "w2" and pname == "weight":
                    tp = Shard(1)
                module.register_parameter(pname, nn.Parameter(
                    distribute_tensor(param.detach(), device_mesh, [Replicate(), tp])))

        def to_spmd(module, args, device_mesh):
            return tuple(DTensor.from_local(a, device_mesh, [Shard(0), Replicate()])
                         for a in args)

        def to_local(module, out, device_mesh):
            return out.redistribute(device_mesh, [Shard(0), Replicate()]).to_local()

        model = TinyLM()
        for block in model.layers:
            distribute_module(block.feed_forward, spmd, partition, input_fn=to_spmd,
                              output_fn=to_local)

        built = _shard_experts_on_their_mesh(model, api, mesh, expert_info, extra)
        extra["placements"] = [str(tuple(p.placements)) for p in model.layers[0].parameters()]
        return built
    if case == "tp_per_param_mesh":
        # Expert-style parallelism: each block's feed-forward tensor-parallel
        # (DTensor parameters) on the "tp" dim of a 2x2 (efsdp, tp) mesh and
        # sharded by FSDP over its "efsdp" dim (ShardPlacementResult); the
        # other parameters over all 4 ranks (fully_shard's 1-D mesh).
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "tp"))
        expert_info = FSDPMeshInfo(mesh_2d["efsdp"], shard_mesh_dim=0)
        model = TinyLM()
        for block in model.layers:
            parallelize_module(block.feed_forward, mesh_2d["tp"],
                               {"w1": ColwiseParallel(), "w2": RowwiseParallel()})

        return _shard_experts_on_their_mesh(model, api, mesh, expert_info, extra)
    if case == "tied_grouped":
        model = TiedLM()
        for layer in (model.body[0], model.body[2]):
            api.fully_shard(layer, mesh=mesh)
        api.fully_shard(model, mesh=mesh)  # embed and head (tied) in the root group

        def tied(m, r, s):
            tokens, targets = lm_batch(r, s)
            return lm_loss(m.head(m(tokens)).flatten(0, 1), targets)

        return model, tied, extra
    if case == "cpu_offload":
        from torch.distributed.fsdp import CPUOffloadPolicy

        model = TinyLM()
        offload = CPUOffloadPolicy(pin_memory=False)
        for block in model.layers:
            api.fully_shard(block, mesh=mesh, offload_policy=offload)
        api.fully_shard(model, mesh=mesh, offload_policy=offload)

        def lm_cpu(m, r, s):
            tokens, targets = lm_batch(r, s)
            return lm_loss(m(tokens), targets)

        return model, lm_cpu, extra
    if case == "frozen":
        model = PartlyFrozen()
        for layer in model:
            api.fully_shard(layer, mesh=mesh)
        api.fully_shard(model, mesh=mesh)
        return model, lambda m, r, s: m(_x(r, s, (4, 12))).pow(2).mean(), extra

    from torch.distributed.fsdp import MixedPrecisionPolicy

    # Divide factors under mixed precision: bf16 reductions pre-multiply
    # (upstream's PREMUL_SUM), fp16 ones split the factor around them.
    mp = {"divide_factor_bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
          "divide_factor_fp16": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                     reduce_dtype=torch.float16)
          }.get(case, MixedPrecisionPolicy())
    model = TinyLM()
    for block in model.layers:
        api.fully_shard(block, mesh=mesh, mp_policy=mp)
    api.fully_shard(model, mesh=mesh, mp_policy=mp)
    fsdp_modules = list(model.layers) + [model]
    if case.startswith("divide_factor"):
        for module in fsdp_modules:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # upstream deprecates this alias
                module.set_reduce_scatter_divide_factor(3.0)
    elif case in ("all_reduce_hook", "all_reduce_hook_stream"):
        # On a CPU mesh upstream runs the hook under torch.cpu.stream(stream),
        # (its all-reduce stream's without one), which orders nothing: same
        # numbers, same calls, the same current stream inside the hook.
        stream = {"stream": torch.cpu.Stream()} if case == "all_reduce_hook_stream" else {}
        extra["hooks"] = [HookRecorder(**stream) for _ in fsdp_modules]
        for module, hook in zip(fsdp_modules, extra["hooks"]):
            module.set_all_reduce_hook(hook, **stream)
    elif case == "force_sum":
        for module in fsdp_modules:
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(3.0)
    elif case == "max_input_buffers":
        # On the root only: the comm context applies the largest cap of its
        # groups (upstream resolves it the same way at lazy init).
        model.set_reduce_scatter_max_input_buffers(3, recurse=False)
    elif case == "separate_reduce_scatter_group":
        model.set_separate_reduce_scatter_group()
        if api.name == "ours":
            # One new group for all (same shard ranks), not the shard group.
            rs_groups = {m._group().reduce_scatter_group for m in fsdp_modules}
            assert len(rs_groups) == 1 and None not in rs_groups, rs_groups
            assert model._group().reduce_scatter_group != model._group().shard_group
    elif case == "custom_comms":
        extra["ag"], extra["rs"] = CountingAllGather(), CountingReduceScatter()
        for module in fsdp_modules:
            module.set_custom_all_gather(extra["ag"])
            module.set_custom_reduce_scatter(extra["rs"])
            # SUM only, so that the custom comm gets an op gloo supports.
            module.set_force_sum_reduction_for_comms(True)
    else:
        raise ValueError(case)

    def lm(m, r, s):
        tokens, targets = lm_batch(r, s)
        return lm_loss(m(tokens), targets)

    return model, lm, extra


def train_case(ctx, backend, mesh_shape, case):
    mesh = make_mesh(ctx, backend, mesh_shape)
    results = {}
    for impl in IMPLS:
        torch.manual_seed(0)
        model, loss_fn, extra = _build(case, fsdp_api(impl), mesh)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, counts = [], []
        for step in range(STEPS):
            with CollectiveCounter() as counter:
                loss = loss_fn(model, ctx.rank, step)
                loss.backward()
            counts.append(dict(counter.counts))
            losses.append(loss.item())
            optim.step()
            optim.zero_grad()
        report = {}
        if "hooks" in extra:
            report["hook_calls"] = [h.calls for h in extra["hooks"]]
            report["hook_streams"] = [sorted(h.streams) for h in extra["hooks"]]
        if "groups_per_block" in extra:
            report["groups_per_block"] = extra["groups_per_block"]
        if "placements" in extra:
            report["placements"] = extra["placements"]
        if "ag" in extra:
            report["custom"] = (extra["ag"].calls, extra["ag"].allocs, extra["rs"].calls,
                                extra["rs"].allocs, sorted(extra["rs"].ops))
        results[impl] = dict(
            losses=losses, counts=counts, report=report,
            full=[p.detach().full_tensor() for p in model.parameters()],
            requires_grad=[p.requires_grad for p in model.parameters()],
        )
    return results


def _run_case(ws, backend, mesh_shape, case, compare_counts=True):
    per_rank = get_pool(ws).run(train_case, backend, mesh_shape, case)
    for rank, results in enumerate(per_rank):
        ours, upstream = results["ours"], results["upstream"]
        what = f"rank {rank} {backend} {mesh_shape} {case}"
        assert ours["losses"] == upstream["losses"], (
            f"{what}: losses\n ours     {ours['losses']}\n upstream {upstream['losses']}")
        assert not compare_counts or ours["counts"] == upstream["counts"], (
            f"{what}: counts\n ours     {ours['counts']}\n upstream {upstream['counts']}")
        assert ours["report"] == upstream["report"], what
        assert ours["requires_grad"] == upstream["requires_grad"], what
        for i, (a, b) in enumerate(zip(ours["full"], upstream["full"])):
            assert torch.equal(a, b), f"{what}: parameter {i} differs"
    return per_rank


@pytest.mark.parametrize("backend", ["fsdp_ext", "gloo"])
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["fsdp", "hsdp"])
def test_all_reduce_hook_matches_upstream(backend, mesh_shape):
    per_rank = _run_case(4 if len(mesh_shape) == 2 else 2, backend, mesh_shape,
                         "all_reduce_hook")
    # One call per group per step, after the reduce-scatter or all-reduce,
    # under the group's own all-reduce stream (the reports equal upstream's).
    assert per_rank[0]["ours"]["report"]["hook_calls"] == [STEPS] * 4
    assert per_rank[0]["ours"]["report"]["hook_streams"] == [["the group's own"]] * 4


def test_all_reduce_hook_with_stream_on_cpu_mesh_matches_upstream():
    per_rank = _run_case(2, "fsdp_ext", (2,), "all_reduce_hook_stream")
    assert per_rank[0]["ours"]["report"]["hook_calls"] == [STEPS] * 4
    # torch.cpu.current_stream() inside the hook is the stream given.
    assert per_rank[0]["ours"]["report"]["hook_streams"] == [["given"]] * 4


def _hook_stream_under_hsdp(ctx, impl):
    api = fsdp_api(impl)
    model = api.fully_shard(nn.Linear(4, 4), mesh=make_mesh(ctx, "fsdp_ext", (2, 2)))
    try:
        model.set_all_reduce_hook(lambda t: None, stream=torch.cpu.Stream())
    except ValueError as e:
        return str(e)
    return None


def test_all_reduce_hook_stream_refused_under_hsdp_as_upstream():
    for impl in IMPLS:
        messages = get_pool(4).run(_hook_stream_under_hsdp, impl)
        assert messages == ["stream cannot be set when using native HSDP"] * 4, (impl, messages)


@requires_upstream("per_param_mesh")
def test_per_param_mesh_matches_upstream():
    """ShardPlacementResult: a block's parameters on two meshes make two
    parameter groups (an all-gather and a reduce-scatter each), with
    upstream's losses, parameters and collective counts."""
    per_rank = _run_case(4, "fsdp_ext", (4,), "per_param_mesh")
    assert per_rank[0]["ours"]["report"]["groups_per_block"] == [2] * len(TinyLM().layers)


@requires_upstream("per_param_mesh")
def test_tensor_parallel_parameters_on_a_per_param_mesh_match_upstream():
    """DTensor (tensor-parallel) parameters with a mesh of their own through
    ShardPlacementResult, as MoE models shard experts: upstream's losses,
    parameters and collective counts."""
    per_rank = _run_case(4, "fsdp_ext", (4,), "tp_per_param_mesh")
    assert per_rank[0]["ours"]["report"]["groups_per_block"] == [2] * len(TinyLM().layers)


@requires_upstream("dp_mesh_dims")
def test_per_param_mesh_with_dp_mesh_dims_matches_upstream():
    """ShardPlacementResult whose FSDPMeshInfo carries dp_mesh_dims (the
    parameters DTensors on a full SPMD mesh): upstream's losses, parameters,
    collective counts and placements."""
    per_rank = _run_case(4, "fsdp_ext", (4,), "spmd_per_param_mesh")
    report = per_rank[0]["ours"]["report"]
    assert report["groups_per_block"] == [2] * len(TinyLM().layers)
    assert "(Shard(dim=0), Shard(dim=1))" in report["placements"], report


def _per_param_mesh_errors(ctx, impl):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        HSDPMeshInfo,
        ShardPlacementResult,
    )
    from torch.distributed.tensor import Shard

    def error(call):
        try:
            call()
        except Exception as e:  # the type and first words are compared
            return f"{type(e).__name__}: {str(e).split(':')[0].split(' is not supported')[0]}"
        return "no error"

    api = fsdp_api(impl)
    mesh = make_mesh(ctx, "fsdp_ext", (4,))
    mesh_2x2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    expert = HSDPMeshInfo(mesh_2x2, shard_mesh_dim=1, replicate_mesh_dim=0)
    twin = HSDPMeshInfo(mesh_2x2, shard_mesh_dim=1, replicate_mesh_dim=0)  # same groups
    out = [error(lambda: api.fully_shard(
        nn.Linear(4, 4), mesh=mesh,
        shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), expert if p.ndim == 2 else twin)))]
    model = api.fully_shard(
        nn.Linear(4, 4), mesh=mesh,
        shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), expert) if p.ndim == 2 else None)
    out.append(len(model._get_fsdp_state()._fsdp_param_groups))
    # The setters that would be ambiguous across meshes refuse several groups.
    out += [error(lambda: model.set_all_reduce_hook(lambda t: None)),
            error(lambda: model.set_custom_all_gather(None)),
            error(lambda: model.set_custom_reduce_scatter(None))]
    if impl == "ours":
        # A layout our placements do not describe is refused up front.
        swapped = HSDPMeshInfo(mesh_2x2, shard_mesh_dim=0, replicate_mesh_dim=1)
        out.append(error(lambda: api.fully_shard(
            nn.Linear(4, 4), mesh=mesh,
            shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), swapped))))
    return out


@requires_upstream("per_param_mesh")
def test_per_param_mesh_errors_match_upstream():
    ours = get_pool(4).run(_per_param_mesh_errors, "ours")
    upstream = get_pool(4).run(_per_param_mesh_errors, "upstream")
    for rank in range(4):
        assert ours[rank][:-1] == upstream[rank], (rank, ours[rank], upstream[rank])
        assert ours[rank][0].startswith("ValueError: Params sharing the same process group")
        assert ours[rank][1] == 2
        assert ours[rank][2:5] == ["ValueError: set_all_reduce_hook", "ValueError: set_custom_all_gather",
                                   "ValueError: set_custom_reduce_scatter"], ours[rank]
        assert ours[rank][5].startswith("NotImplementedError: torch_fsdp_ext.fully_shard"), ours[rank]


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["fsdp", "hsdp"])
def test_force_sum_reduction_matches_upstream(mesh_shape):
    _run_case(4 if len(mesh_shape) == 2 else 2, "fsdp_ext", mesh_shape, "force_sum")


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["fsdp", "hsdp"])
@pytest.mark.parametrize("case", ["divide_factor_bf16", "divide_factor_fp16"])
def test_divide_factor_with_mixed_precision_matches_upstream(mesh_shape, case):
    _run_case(4 if len(mesh_shape) == 2 else 2, "fsdp_ext", mesh_shape, case)


def test_custom_comms_match_upstream():
    per_rank = _run_case(2, "gloo", (2,), "custom_comms")
    ag_calls, ag_allocs, rs_calls, rs_allocs, ops = per_rank[0]["ours"]["report"]["custom"]
    # Every collective went through the custom objects, which allocated
    # every buffer they were used with.
    counts = per_rank[0]["ours"]["counts"]
    assert ag_calls == sum(c.get(AG, 0) for c in counts) > 0
    assert rs_calls == sum(c.get(RS, 0) for c in counts) > 0
    assert ag_allocs == ag_calls and rs_allocs == 2 * rs_calls
    assert ops == ["ReduceOp.SUM"] or ops == ["RedOpType.SUM"], ops


@requires_upstream("separate_reduce_scatter_group")
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["fsdp", "hsdp"])
def test_separate_reduce_scatter_group_matches_upstream(mesh_shape):
    _run_case(4 if len(mesh_shape) == 2 else 2, "fsdp_ext", mesh_shape,
              "separate_reduce_scatter_group")


@requires_upstream("reduce_scatter_max_input_buffers")
def test_reduce_scatter_max_input_buffers_matches_upstream():
    _run_case(2, "fsdp_ext", (2,), "max_input_buffers")


@requires_upstream("reduce_scatter_unused_params")
def test_unused_params_on_some_ranks_match_upstream():
    per_rank = _run_case(2, "fsdp_ext", (2,), "unused_params")
    # One reduce-scatter per group, the root's carrying both branches (one
    # of them zeros) on every rank.
    assert per_rank[0]["ours"]["counts"][0][RS] == 3


@pytest.mark.parametrize("backend", ["fsdp_ext", "gloo"])
def test_grouped_head_called_per_chunk_matches_upstream(backend):
    """fully_shard([norm, head]) where forward skips the head and the loss
    applies it per chunk: the head's gradients are reduced like upstream's
    (before torch 2.13 upstream's reduce-scatter once fewer per step, with the
    same numbers: fsdp_testing.UPSTREAM_SINCE)."""
    _run_case(2, backend, (2,), "chunked_head",
              compare_counts=upstream_has("grouped_outside_forward"))


@requires_upstream("grouped_outside_forward")
def test_grouped_head_called_alone_after_backward_matches_upstream():
    """Regression: the second backward's gradients of a grouped module run on
    its own were issued but never completed, so the head lost them."""
    _run_case(2, "fsdp_ext", (2,), "grouped_head_after_backward")


def test_tied_weights_in_one_group_match_upstream():
    _run_case(2, "fsdp_ext", (2,), "tied_grouped")


def test_cpu_offload_on_cpu_mesh_matches_upstream():
    """CPUOffloadPolicy(pin_memory=False) on a CPU mesh: parameters,
    gradients and optimizer state stay on the host, as upstream's."""
    _run_case(2, "fsdp_ext", (2,), "cpu_offload")


def test_cpu_offload_pinning_behaves_as_upstream(pool2):
    """pin_memory=True pins the sharded parameters, which needs an
    accelerator: where there is none both implementations raise the same
    error at fully_shard; where there is one both succeed."""
    results = pool2.run(_pinned_offload)
    assert results[0]["ours"] == results[0]["upstream"], results[0]


def _pinned_offload(ctx):
    from torch.distributed.fsdp import CPUOffloadPolicy

    mesh = make_mesh(ctx, "fsdp_ext", (ctx.world_size,))
    out = {}
    for impl in IMPLS:
        try:
            model = fsdp_api(impl).fully_shard(nn.Linear(4, 4), mesh=mesh,
                                               offload_policy=CPUOffloadPolicy())
            out[impl] = ("pinned", model.weight.to_local().is_pinned())
        except RuntimeError as error:
            out[impl] = ("error", str(error))
    return out


def test_frozen_and_trainable_params_match_upstream():
    _run_case(2, "fsdp_ext", (2,), "frozen")


# --------------------------------------------------------------------------
# Errors and setters


def test_setter_errors_match_upstream(pool2):
    results = pool2.run(_setter_errors)
    ours, upstream = dict(results[0]["ours"]), dict(results[0]["upstream"])
    assert "shared with a parameter already managed by another FSDP group" in (
        ours["tied_separately"])
    if not upstream_has("tied_across_groups_refused"):
        assert upstream.pop("tied_separately") == "no error", upstream
        del ours["tied_separately"]
    assert ours == upstream, results[0]


def _setter_errors(ctx):
    mesh = make_mesh(ctx, "fsdp_ext", (ctx.world_size,))
    out = {}
    for impl in IMPLS:
        api = fsdp_api(impl)
        errors = {}
        model = TiedLM()
        api.fully_shard(model.head, mesh=mesh)
        api.fully_shard(model, mesh=mesh)
        try:
            model(torch.zeros(2, 3, dtype=torch.long))
            errors["tied_separately"] = "no error"
        except ValueError as error:
            errors["tied_separately"] = str(error)
        if not upstream_has("reduce_scatter_max_input_buffers"):
            out[impl] = errors
            continue
        model = nn.Sequential(nn.Linear(4, 4))
        api.fully_shard(model, mesh=mesh)
        for bad in (0, True, 1.5):
            try:
                model.set_reduce_scatter_max_input_buffers(bad)
                errors[repr(bad)] = "no error"
            except (TypeError, ValueError) as error:
                errors[repr(bad)] = f"{type(error).__name__}: {error}"
        out[impl] = errors
    return out


def test_share_comm_ctx_between_roots_matches_upstream(pool2):
    results = pool2.run(_share_comm_ctx)
    for rank_result in results:
        assert rank_result["ours"] == rank_result["upstream"], rank_result


def _share_comm_ctx(ctx):
    """Two pipeline-stage roots sharing one comm context train as upstream's."""
    from torch.distributed.fsdp import share_comm_ctx as upstream_share

    import torch_fsdp_ext

    mesh = make_mesh(ctx, "fsdp_ext", (ctx.world_size,))
    out = {}
    for impl, share in (("ours", torch_fsdp_ext.share_comm_ctx), ("upstream", upstream_share)):
        api = fsdp_api(impl)
        torch.manual_seed(0)
        stages = [nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(2)]
        for stage in stages:
            api.fully_shard(stage[0], mesh=mesh)
            api.fully_shard(stage, mesh=mesh)
        share(stages)
        same = stages[0]._get_fsdp_state()._comm_ctx is stages[1]._get_fsdp_state()._comm_ctx
        params = [p for s in stages for p in s.parameters()]
        optim = torch.optim.SGD(params, lr=0.1)
        losses = []
        for step in range(STEPS):
            loss = stages[1](stages[0](_x(ctx.rank, step))).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        out[impl] = (same, losses)
    return out


# --------------------------------------------------------------------------
# GradScaler with fp16 parameters


def test_grad_scaler_fp16_matches_upstream(pool2):
    results = pool2.run(_grad_scaler)
    for rank_result in results:
        assert rank_result["ours"] == rank_result["upstream"], rank_result
        record = rank_result["ours"][0]
        # The overflow step's loss is nan and the scaler halved its scale.
        assert record[1] == ("nan", record[0][1] / 2), record


def _grad_scaler(ctx):
    """fp16 all-gathers with fp32 reduction, scaled loss, a step skipped for
    an inf gradient (the scaler halves its scale), then normal steps."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = make_mesh(ctx, "fsdp_ext", (ctx.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    out = {}
    for impl in IMPLS:
        api = fsdp_api(impl)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        api.fully_shard(model[0], mesh=mesh, mp_policy=mp)
        api.fully_shard(model, mesh=mesh, mp_policy=mp)
        optim = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        record = []
        for step in range(STEPS):
            x = _x(ctx.rank, step)
            if step == 1:
                x = x * float("inf")  # an overflow: this step must be skipped
            loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(optim)
            scaler.update()
            optim.zero_grad()
            record.append((repr(loss.item()), scaler.get_scale()))  # repr: nan == nan
        out[impl] = (record, [p.detach().full_tensor().tolist() for p in model.parameters()])
    return out


# --------------------------------------------------------------------------
# Distributed checkpoint: saved at one world size, loaded at another


def test_checkpoint_saved_at_4_loads_at_2(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = get_pool(4).run(_save_checkpoint, path)
    loaded = get_pool(2).run(_load_checkpoint, path)
    for rank_result in loaded:
        for impl in IMPLS:
            full, loss = rank_result[impl]
            assert [torch.equal(a, b) for a, b in zip(full, saved[0]["full"])] == [True] * len(full)
            # Training resumes where it stopped: the same loss either way.
            assert loss == rank_result["upstream"][1]


def _lm_sharded(api, mesh):
    torch.manual_seed(0)
    model = TinyLM()
    for block in model.layers:
        api.fully_shard(block, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    return model


def _save_checkpoint(ctx, path):
    """Ours trains two steps at world size 4 and saves model and optimizer
    state with torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    mesh = make_mesh(ctx, "fsdp_ext", (ctx.world_size,))
    model = _lm_sharded(fsdp_api("ours"), mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(2):
        tokens, targets = lm_batch(ctx.rank, step)
        lm_loss(model(tokens), targets).backward()
        optim.step()
        optim.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return {"full": [p.detach().full_tensor() for p in model.parameters()]}


def _load_checkpoint(ctx, path):
    """Both implementations load the world-size-4 checkpoint at world size 2
    and take one more step on the same batch."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = make_mesh(ctx, "fsdp_ext", (ctx.world_size,))
    out = {}
    for impl in IMPLS:
        model = _lm_sharded(fsdp_api(impl), mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=0.01)
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        full = [p.detach().full_tensor() for p in model.parameters()]
        tokens, targets = lm_batch(ctx.rank, 2)
        loss = lm_loss(model(tokens), targets)
        loss.backward()
        optim.step()
        out[impl] = (full, loss.item())
    return out


# --------------------------------------------------------------------------
# FSDP + tensor parallelism on a 2x2 (dp, tp) mesh


class TPBlock(nn.Module):
    """A norm (left plain: FSDP shards it on dp only) and a column- then
    row-parallel MLP (DTensor parameters on the tp mesh)."""

    def __init__(self, dim=16, hidden=32):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.w2(F.relu(self.w1(self.norm(x))))


class TPModel(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(TPBlock(dim) for _ in range(2))
        self.out = nn.Linear(dim, 8)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


class EPTPLinear(nn.Linear):
    """A Linear whose weight is a DTensor on a 2-D (ep, tp) mesh, used whole
    (full_tensor) in forward: FSDP over an EP+TP parameter."""

    def forward(self, x):
        return F.linear(x, self.weight.full_tensor(), self.bias)


@pytest.mark.parametrize("backend,precision,layout", [
    ("fsdp_ext", "fp32", "fsdp"), ("gloo", "fp32", "fsdp"), ("fsdp_ext", "bf16", "fsdp"),
    ("fsdp_ext", "bf16-no-sync", "fsdp"), ("fsdp_ext", "bf16-reduce-unset", "fsdp"),
    ("fsdp_ext", "fp32", "hsdp"),
    ("fsdp_ext", "fp32", "ep_tp"),
])
def test_fsdp_with_tensor_parallel_matches_upstream(backend, precision, layout):
    """FSDP + TP on a 2x2 (dp, tp) mesh; HSDP + TP on (replicate 2, shard 1,
    tp 2); an EP+TP parameter on (dp 2, ep 2, tp 1). "bf16-reduce-unset":
    from torch 2.15 gradients are reduced in fp32 then, and the row-parallel
    bias (Replicate on tp, its gradient Partial) takes fp32 gradients from
    autograd, so TP's all-reduce of it runs in fp32 too, as upstream's."""
    results = get_pool(4).run(_train_fsdp_tp, backend, precision, layout)
    for rank, rank_result in enumerate(results):
        ours, upstream = rank_result["ours"], rank_result["upstream"]
        for key in ("losses", "norms", "placements", "state_dict", "counts", "errors"):
            assert ours[key] == upstream[key], f"rank {rank} {backend} {key}:\n {ours[key]}\n {upstream[key]}"
        for i, (a, b) in enumerate(zip(ours["full"], upstream["full"])):
            assert torch.equal(a, b), f"rank {rank} {backend}: parameter {i} differs"
    # The clipping is active (the norms exceed max_norm 0.05).
    assert min(results[0]["ours"]["norms"]) > 0.05, results[0]["ours"]["norms"]
    placements = results[0]["ours"]["placements"]
    expected = {
        # TP's Shard(0) weights are strided on dp; the plain norm only on dp.
        "fsdp": ["(_StridedShard(dim=0, sf=2), Shard(dim=0))", "(Shard(dim=0),)"],
        "hsdp": ["(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))",
                 "(Replicate(), Shard(dim=0))"],
        "ep_tp": ["(_StridedShard(dim=0, sf=2), Shard(dim=0), Shard(dim=1))"],
    }[layout]
    for placement in expected:
        assert placement in placements, (placement, placements)
    assert results[0]["ours"]["errors"] == (["checked"] if layout == "hsdp" else [])


def _clip_grad_norm_across_meshes(params, max_norm):
    """clip_grad_norm_ for parameters on two meshes (TP weights on (dp, tp),
    plain ones on dp), which torch's cannot stack or scale in one foreach:
    the total norm per mesh, combined, then torch's clip_grads_with_norm_
    per mesh (the recipe torchtitan uses)."""
    by_mesh = {}
    for p in params:
        by_mesh.setdefault(p.device_mesh, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]).full_tensor()
             for group in by_mesh.values()]
    total = torch.stack(norms).norm()
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total.item()


def _train_fsdp_tp(ctx, backend, precision, layout):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    shape, names = {"fsdp": ((2, 2), ("dp", "tp")),
                    "hsdp": ((2, 1, 2), ("rep", "shard", "tp")),
                    "ep_tp": ((2, 2, 1), ("dp", "ep", "tp"))}[layout]
    override = None if backend == "fsdp_ext" else {d: "gloo" for d in range(len(shape))}
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names, backend_override=override)
    dp_mesh = mesh["rep", "shard"] if layout == "hsdp" else mesh["dp"]
    # Ranks of one TP/EP group see the same batch.
    dp_rank = ctx.rank // 2
    mp = MixedPrecisionPolicy()
    if precision.startswith("bf16"):
        reduce_dtype = None if precision == "bf16-reduce-unset" else torch.float32
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    # "-no-sync": two microbatches per step, the first without gradient sync
    # (bf16 gradients accumulate in fp32, TP gradients unwrapped first).
    microbatches = 2 if precision.endswith("no-sync") else 1
    errors = []
    if layout == "hsdp":
        # A parameter on a 3-D mesh: upstream's limit and message (here the
        # mesh also overlaps the data-parallel one, which upstream's reports
        # first, as a RuntimeError from DeviceMesh; ours checks the dims first).
        three_d = nn.Linear(4, 4)
        three_d.weight = nn.Parameter(distribute_tensor(
            three_d.weight.detach(), mesh, [Replicate(), Replicate(), Shard(0)]))
        with pytest.raises(NotImplementedError, match="FSDP only supports 1D TP/EP or 2D EP"):
            fsdp_api("ours").fully_shard(three_d, mesh=dp_mesh)
        errors.append("checked")
    if layout == "fsdp" and precision == "fp32":
        # A DTensor whose local tensor is not contiguous: FSDP shards the
        # local tensor, so the same error as for a plain parameter.
        from torch.distributed.tensor import DTensor

        strided = nn.Linear(4, 8)
        strided.weight = nn.Parameter(DTensor.from_local(
            torch.randn(4, 8).t(), mesh["tp"], [Shard(0)], run_check=False))
        assert not strided.weight._local_tensor.is_contiguous()
        with pytest.raises(NotImplementedError,
                           match="FSDP does not support non-contiguous parameters"):
            fsdp_api("ours").fully_shard(strided, mesh=dp_mesh)
    out = {}
    for impl in IMPLS:
        api = fsdp_api(impl)
        torch.manual_seed(0)
        model = TPModel()
        for block in model.blocks:
            if layout == "ep_tp":
                expert = EPTPLinear(16, 32)
                expert.load_state_dict(block.w1.state_dict())
                expert.weight = nn.Parameter(distribute_tensor(
                    expert.weight.detach(), mesh["ep", "tp"], [Shard(0), Shard(1)]))
                block.w1 = expert
            else:
                parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(),
                                                        "w2": RowwiseParallel()})
            api.fully_shard(block, mesh=dp_mesh, mp_policy=mp)
        api.fully_shard(model, mesh=dp_mesh, mp_policy=mp)
        optim = torch.optim.AdamW(model.parameters(), lr=0.01)
        losses, norms, counts = [], [], []
        for step in range(STEPS):
            with CollectiveCounter() as counter:
                for micro in range(microbatches):
                    model.set_requires_gradient_sync(micro == microbatches - 1)
                    loss = model(_x(dp_rank, step * 2 + micro)).float().pow(2).mean()
                    loss.backward()
            counts.append(dict(counter.counts))
            norms.append(_clip_grad_norm_across_meshes(list(model.parameters()), 0.05))
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        state = model.state_dict()
        out[impl] = dict(
            losses=losses, norms=norms, counts=counts, errors=errors,
            placements=[str(tuple(p.placements)) for p in model.parameters()],
            state_dict=sorted((k, str(tuple(v.placements)), tuple(v.shape))
                              for k, v in state.items()),
            full=[p.detach().full_tensor() for p in model.parameters()],
        )
    return out


# --------------------------------------------------------------------------
# dp_mesh_dims: every parameter a DTensor on the full (dp, tp) mesh


def _spmd_model(mesh):
    """TPModel with every parameter distributed on the full 2-D mesh,
    replicated over dp; inputs enter as DTensors sharded over dp."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, \
        distribute_tensor

    def partition(name, module, device_mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            tp = Replicate()
            if name.endswith("w1"):
                tp = Shard(0)
            elif name.endswith("w2") and pname == "weight":
                tp = Shard(1)
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param.detach(), device_mesh, [Replicate(), tp])))

    def inputs(module, args, device_mesh):
        return tuple(DTensor.from_local(a, device_mesh, [Shard(0), Replicate()]) for a in args)

    torch.manual_seed(0)
    return distribute_module(TPModel(), mesh, partition, input_fn=inputs)


@requires_upstream("dp_mesh_dims")
@pytest.mark.parametrize("shape,dims", [((2, 2), "fsdp"), ((2, 2), "hsdp"), ((2, 2), "ddp")])
def test_dp_mesh_dims_matches_upstream(shape, dims):
    results = get_pool(4).run(_train_spmd, shape, dims)
    for rank, rank_result in enumerate(results):
        ours, upstream = rank_result["ours"], rank_result["upstream"]
        for key in ("losses", "placements", "counts", "errors"):
            assert ours[key] == upstream[key], f"rank {rank} {dims} {key}:\n {ours[key]}\n {upstream[key]}"
        for i, (a, b) in enumerate(zip(ours["full"], upstream["full"])):
            assert torch.equal(a, b), f"rank {rank} {dims}: parameter {i} differs"
    ours = results[0]["ours"]
    assert all(e != "no error" for e in ours["errors"]), ours["errors"]
    if dims == "fsdp":
        # w1 is TP-sharded on dim 0, so FSDP's dp placement is strided.
        assert "(_StridedShard(dim=0, sf=2), Shard(dim=0))" in ours["placements"], ours
    elif dims == "ddp":
        # Nothing sharded over dp: the parameters' own placements.
        assert "(Replicate(), Shard(dim=0))" in ours["placements"], ours
        assert all(p.startswith("(Replicate(),") for p in ours["placements"]), ours
    else:
        assert "(Replicate(), Shard(dim=0))" in ours["placements"], ours


def _train_spmd(ctx, shape, dims):
    """"fsdp": shard over dp, TP over tp; "ddp": the same mesh and model,
    dp only replicating (all-reduce, no sharding). "hsdp": a (replicate,
    shard) mesh whose parameters are plain replicas, DataParallelMeshDims
    naming both."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, \
        distribute_tensor

    if dims in ("fsdp", "ddp"):
        # Distinct dim names per case: DTensor caches specs by equal meshes,
        # and upstream checks the parameters' mesh by identity.
        dp_name = "dp" if dims == "fsdp" else "ddp"
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=(dp_name, "tp"))
        dp_dims = (DataParallelMeshDims(shard="dp") if dims == "fsdp"
                   else DataParallelMeshDims(replicate="ddp"))
    else:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("rep", "shard"))
        dp_dims = DataParallelMeshDims(shard="shard", replicate="rep")
    out = {}
    for impl in IMPLS:
        api = fsdp_api(impl)
        errors = []
        # A plain parameter, and a misplaced DTensor, are refused (ValueError).
        for bad in ("plain", "sharded_on_dp"):
            lin = nn.Linear(4, 4)
            if bad == "sharded_on_dp":
                lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh,
                                                            [Shard(0), Replicate()]))
                lin.bias = nn.Parameter(distribute_tensor(lin.bias.detach(), mesh,
                                                          [Replicate(), Replicate()]))
            try:
                api.fully_shard(lin, mesh=mesh, dp_mesh_dims=dp_dims)
                errors.append("no error")
            except ValueError as error:
                errors.append(str(error))
        if dims in ("fsdp", "ddp"):
            model = _spmd_model(mesh)
        else:
            torch.manual_seed(0)

            def replicate(name, module, device_mesh):
                for pname, param in list(module.named_parameters(recurse=False)):
                    module.register_parameter(pname, nn.Parameter(distribute_tensor(
                        param.detach(), device_mesh, [Replicate(), Replicate()])))

            def inputs(module, args, device_mesh):
                return tuple(DTensor.from_local(a, device_mesh, [Shard(0), Shard(0)])
                             for a in args)

            model = distribute_module(TPModel(), mesh, replicate, input_fn=inputs)
        for block in model.blocks:
            api.fully_shard(block, mesh=mesh, dp_mesh_dims=dp_dims)
        api.fully_shard(model, mesh=mesh, dp_mesh_dims=dp_dims)
        optim = torch.optim.SGD(model.parameters(), lr=0.05)
        losses, counts = [], []
        batch_rank = mesh.get_local_rank(0) if dims in ("fsdp", "ddp") else ctx.rank
        for step in range(STEPS):
            with CollectiveCounter() as counter:
                loss = model(_x(batch_rank, step)).to_local().pow(2).mean()
                loss.backward()
            counts.append(dict(counter.counts))
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        out[impl] = dict(
            losses=losses, counts=counts, errors=errors,
            placements=[str(tuple(p.placements)) for p in model.parameters()],
            full=[p.detach().full_tensor() for p in model.parameters()],
        )
    return out
