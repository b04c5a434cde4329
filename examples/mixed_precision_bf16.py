"""bf16 mixed precision with torch_fsdp_ext.fully_shard over fsdp_ext.

    torchrun --standalone --nproc-per-node 2 examples/mixed_precision_bf16.py
        [--steps 10] [--check-upstream] [--losses-json losses.json]

MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32): each block's
parameters are all-gathered and computed with in bf16, gradients are reduced
in fp32, and the sharded parameters and the optimizer stay fp32.

--check-upstream trains the same model a second time, in the same processes,
with torch's own fully_shard over a gloo group, and says whether the losses
are the same bit for bit (ours is a drop-in: they are).
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.fsdp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import torch_fsdp_ext  # registers the fsdp_ext backend; our fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_transformer import TinyTransformer, batch_for  # noqa: E402


def train(fully_shard, mesh, steps):
    """Shards a fresh model (same seed every call) and trains it; returns the
    per-step losses (averaged over ranks) and the dtypes seen."""
    policy = torch_fsdp_ext.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32)
    torch.manual_seed(0)
    model = TinyTransformer(layers=2)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rank = dist.get_rank()
    losses = []
    for step in range(steps):
        tokens, targets = batch_for(rank, step)
        logits = model(tokens)  # bf16: computed with bf16 parameters
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        dist.all_reduce(loss_avg := loss.detach().clone(), op=dist.ReduceOp.AVG)
        losses.append(loss_avg.item())
    param = next(model.parameters())
    return {"losses": losses, "logits_dtype": str(logits.dtype), "param_dtype": str(param.dtype),
            "optimizer_state_dtype": str(optim.state[param]["exp_avg"].dtype)}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--check-upstream", action="store_true",
                        help="also train with torch's fully_shard over gloo and compare")
    parser.add_argument("--losses-json", help="rank 0 writes the results here")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("fsdp_ext")
    world = dist.get_world_size()
    ours = train(torch_fsdp_ext.fully_shard, init_device_mesh("cpu", (world,)), args.steps)
    results = {"ours": ours}
    if args.check_upstream:
        gloo_mesh = init_device_mesh("cpu", (world,), backend_override={0: "gloo"})
        results["upstream"] = train(torch.distributed.fsdp.fully_shard, gloo_mesh, args.steps)

    if dist.get_rank() == 0:
        print(f"bf16 compute ({ours['logits_dtype']} logits), fp32 reduction, "
              f"{ours['param_dtype']} sharded parameters, {world} ranks")
        for step, loss in enumerate(ours["losses"]):
            upstream = results.get("upstream", {}).get("losses")
            print(f"step {step:3d}  loss {loss:.6f}"
                  + (f"  upstream over gloo {upstream[step]:.6f}" if upstream else ""))
        if args.check_upstream:
            same = ours["losses"] == results["upstream"]["losses"]
            print("same losses as torch's fully_shard over gloo, bit for bit" if same
                  else "losses differ from torch's fully_shard over gloo")
        if args.losses_json:
            with open(args.losses_json, "w") as out:
                json.dump(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
