"""One rank of a Lightning Fabric training run with its FSDP2 strategy
(``ModelParallelStrategy``) over the fsdp_ext backend, launched by torchrun
from test_framework_fabric.py.

Two runs in the same processes, from the same weights and batches:
- "upstream": the framework as it is, torch's fully_shard;
- "routed": the same code inside ``torch_fsdp_ext.use_as_fully_shard()``.

The parallelize function below is the user's side of Fabric's strategy and,
like recipes written for upstream, names ``torch.distributed.fsdp.fully_shard``.
Fabric itself sets up the process group and the device mesh, gates gradient
sync with ``no_backward_sync`` (which looks for ``FSDPModule`` instances),
runs backward and clips gradients. Each rank writes ``rank<N>.json`` into
the folder named by its first argument.
"""

import hashlib
import json
import os
import sys

import torch
import torch.distributed.fsdp
from torch.distributed.tensor.debug import CommDebugMode

import torch_fsdp_ext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_testing import TinyLM, lm_batch, lm_loss  # noqa: E402



def parallelize(model, device_mesh):
    import torch.distributed.fsdp

    dp_mesh = device_mesh["data_parallel"]
    for block in model.layers:
        torch.distributed.fsdp.fully_shard(block, mesh=dp_mesh)
    torch.distributed.fsdp.fully_shard(model, mesh=dp_mesh)
    return model


def train(steps=4):
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1,
                                     process_group_backend="fsdp_ext")
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(TinyLM())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    losses, reduce_scatters = [], []
    for step in range(steps):
        tokens, targets = lm_batch(fabric.global_rank, step)
        # Two micro-batches per optimizer step: the first without gradient sync.
        accumulating = step % 2 == 0
        with CommDebugMode() as comm, fabric.no_backward_sync(model, enabled=accumulating):
            loss = lm_loss(model(tokens), targets)
            fabric.backward(loss)
        reduce_scatters.append(sum(count for op, count in comm.get_comm_counts().items()
                                   if "reduce_scatter" in str(op)))
        if not accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().full_tensor().numpy().tobytes())
    return {"losses": losses, "reduce_scatters": reduce_scatters,
            "fsdp_modules": sum(isinstance(m, torch.distributed.fsdp.FSDPModule)
                                for m in model.modules()),
            "our_modules": sum(isinstance(m, torch_fsdp_ext.FSDPModule) for m in model.modules()),
            "params_sha256": digest.hexdigest(),
            "backend": torch.distributed.get_backend()}


def main():
    upstream = train()
    with torch_fsdp_ext.use_as_fully_shard():
        routed = train()
    rank = int(os.environ["RANK"])
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as out:
        json.dump({"rank": rank, "upstream": upstream, "routed": routed}, out)


if __name__ == "__main__":
    main()
