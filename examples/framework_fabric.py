"""A framework on our FSDP2: Lightning Fabric's ModelParallelStrategy with
torch_fsdp_ext.use_as_fully_shard() and the fsdp_ext backend.

    pip install lightning-fabric
    torchrun --standalone --nproc-per-node 2 examples/framework_fabric.py
        [--steps 8] [--losses-json losses.json]

Fabric creates the process group (process_group_backend="fsdp_ext") and the
device mesh, then calls the user's parallelize function, which names
torch.distributed.fsdp.fully_shard as any FSDP2 recipe does. One call,
torch_fsdp_ext.use_as_fully_shard(), makes that name ours; nothing else in
the training code changes: our modules are instances of torch's FSDPModule,
so Fabric's own FSDP2 code (setup, gradient clipping, no_backward_sync,
fabric.save) accepts them.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed.fsdp
import torch.nn.functional as F
from lightning_fabric import Fabric
from lightning_fabric.strategies import ModelParallelStrategy

import torch_fsdp_ext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_transformer import TinyTransformer, batch_for  # noqa: E402


def parallelize(model, device_mesh):
    """The user's side of ModelParallelStrategy, written for torch's FSDP2."""
    dp_mesh = device_mesh["data_parallel"]
    for block in model.blocks:
        torch.distributed.fsdp.fully_shard(block, mesh=dp_mesh)
    torch.distributed.fsdp.fully_shard(model, mesh=dp_mesh)
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--losses-json", help="rank 0 writes the losses and facts here")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch_fsdp_ext.use_as_fully_shard()  # torch.distributed.fsdp.fully_shard is ours from here
    world = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's; Fabric checks they agree
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    strategy = ModelParallelStrategy(parallelize, data_parallel_size=world,
                                     tensor_parallel_size=1, process_group_backend="fsdp_ext")
    fabric = Fabric(accelerator="cpu", devices=per_node, num_nodes=world // per_node,
                    strategy=strategy)
    fabric.launch()

    torch.manual_seed(0)
    model = fabric.setup_module(TinyTransformer(layers=2))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    ours = sum(isinstance(m, torch_fsdp_ext.FSDPModule) for m in model.modules())
    fsdp = sum(isinstance(m, torch.distributed.fsdp.FSDPModule) for m in model.modules())
    fabric.print(f"{ours} of {fsdp} FSDP modules are torch_fsdp_ext's, backend "
                 f"{torch.distributed.get_backend()}, {world} ranks")

    losses = []
    for step in range(args.steps):
        tokens, targets = batch_for(fabric.global_rank, step)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        fabric.print(f"step {step:3d}  loss {losses[-1]:.6f}")

    if fabric.global_rank == 0 and args.losses_json:
        with open(args.losses_json, "w") as out:
            json.dump({"losses": losses, "our_modules": ours, "fsdp_modules": fsdp,
                       "backend": torch.distributed.get_backend()}, out)


if __name__ == "__main__":
    main()
