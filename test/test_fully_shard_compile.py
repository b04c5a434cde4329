"""torch.compile with our fully_shard: ours against upstream's, the same losses
and parameters bit for bit.

Two ways users compile FSDP2 models: each block compiled on its own after
fully_shard (torchtitan's way; inductor, the default backend, so generated
kernels run between our hooks), and the whole model (aot_eager: dynamo traces
through the module hooks, breaking the graph at them, without inductor's
compile time)."""

import pytest
import torch
import torch.nn.functional as F

from conftest import get_pool
from fsdp_testing import IMPLS, MLP, MLPStack, fsdp_api, mlp_batch


def train_compiled(ctx, how):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    out = {}
    for impl in IMPLS:
        api = fsdp_api(impl)
        torch._dynamo.reset()  # each implementation compiles its own graphs
        torch.manual_seed(0)
        model = MLPStack(n=3)
        for module in model:
            if isinstance(module, MLP):
                api.fully_shard(module, mesh=mesh)
                if how == "per_block":
                    module.compile()
        api.fully_shard(model, mesh=mesh)
        if how == "whole":
            model.compile(backend="aot_eager")
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            x = mlp_batch(ctx.rank, step)
            loss = F.mse_loss(model(x), torch.sin(x))
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        out[impl] = (losses, [p.detach().full_tensor() for p in model.parameters()])
    return out


@pytest.mark.parametrize("how", ["per_block", "whole"])
def test_compiled_training_matches_upstream(how):
    for rank, out in enumerate(get_pool(2).run(train_compiled, how)):
        ours, upstream = out["ours"], out["upstream"]
        assert ours[0] == upstream[0], (rank, how, ours[0], upstream[0])
        for i, (a, b) in enumerate(zip(ours[1], upstream[1])):
            assert torch.equal(a, b), (rank, how, f"parameter {i} differs")
