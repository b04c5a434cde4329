"""Checkpoint and resume: fully_shard over fsdp_ext, torch.distributed.checkpoint
(DCP), and torchrun restarting the job after a rank dies.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 \\
        examples/checkpoint_resume.py --checkpoint-dir /tmp/ckpt [--steps 12]
        [--save-every 4] [--crash-after-step 6] [--losses-json losses.json]

Every --save-every steps all ranks save the sharded model and optimizer state
(plus the step and the losses so far) with DCP, each rank writing its own
shards. On start the job loads the newest complete checkpoint in
--checkpoint-dir, if any, and carries on from there (run it again with more
--steps and it trains on). Training is deterministic (fixed seed, the batch a
function of rank and step), so a resumed run prints the same losses, bit for
bit, as one that never stopped.

--crash-after-step K makes rank 1 die after step K on the first attempt
(TORCHELASTIC_RESTART_COUNT=0): the fsdp_ext group reports the dead peer
within seconds, torchrun (--max-restarts) starts all ranks again, and they
resume from the last checkpoint. Across hosts --checkpoint-dir must be a
shared file system.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from torch_fsdp_ext import fully_shard  # importing the package registers the fsdp_ext backend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_transformer import TinyTransformer, batch_for  # noqa: E402


class TrainState(Stateful):
    """What a checkpoint holds. DCP calls state_dict() when saving and
    load_state_dict() when loading; get_state_dict gives the model's and the
    optimizer's state as DTensors keyed by parameter name, so each rank saves
    and loads only its own shards."""

    def __init__(self, model, optim):
        self.model, self.optim = model, optim
        self.step, self.losses = 0, []

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd, "step": self.step, "losses": self.losses}

    def load_state_dict(self, state):
        set_state_dict(self.model, self.optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.step, self.losses = state["step"], state["losses"]


def latest_checkpoint(directory):
    """The newest complete checkpoint: DCP writes .metadata last, so a folder
    without it is one a crash interrupted."""
    done = [name for name in os.listdir(directory) if name.startswith("step_")
            and os.path.exists(os.path.join(directory, name, ".metadata"))]
    return os.path.join(directory, max(done)) if done else None


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--crash-after-step", type=int, default=None,
                        help="rank 1 dies after this step on the first attempt (a demo of restart)")
    parser.add_argument("--losses-json", help="rank 0 writes the losses and the run's facts here")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("fsdp_ext")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))

    torch.manual_seed(0)
    model = TinyTransformer(layers=2)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    state = TrainState(model, optim)

    os.makedirs(args.checkpoint_dir, exist_ok=True)
    resumed_from = latest_checkpoint(args.checkpoint_dir)  # nobody writes there yet: all agree
    if resumed_from:
        dcp.load({"train": state}, checkpoint_id=resumed_from)
        if rank == 0:
            print(f"attempt {attempt}: resuming at step {state.step} from {resumed_from}",
                  flush=True)

    for step in range(state.step, args.steps):
        tokens, targets = batch_for(rank, step)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        dist.all_reduce(loss_avg := loss.detach().clone(), op=dist.ReduceOp.AVG)
        state.step, state.losses = step + 1, state.losses + [loss_avg.item()]
        if rank == 0:
            print(f"step {step:3d}  loss {state.losses[-1]:.6f}", flush=True)
        if state.step % args.save_every == 0:
            dcp.save({"train": state},
                     checkpoint_id=os.path.join(args.checkpoint_dir, f"step_{state.step:06d}"))
        if step == args.crash_after_step and attempt == 0 and rank == 1:
            print(f"rank 1: dying after step {step} (attempt 0)", flush=True)
            os._exit(1)

    if rank == 0:
        print(f"done: {args.steps} steps, attempt {attempt}", flush=True)
        if args.losses_json:
            with open(args.losses_json, "w") as out:
                json.dump({"losses": state.losses, "attempt": attempt,
                           "resumed_from": resumed_from,
                           "world_size": dist.get_world_size()}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
