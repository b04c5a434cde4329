"""A small causal transformer LM, enough to exercise FSDP over many blocks."""

import warnings

import torch
from torch import nn

# The head, a Linear on (batch, seq, dim) activations, returns a view; so
# fully_shard (ours, and torch's from 2.13) warns that changing the root's
# output in place would drop its pre-backward hook. No example changes the
# logits in place.
warnings.filterwarnings("ignore", message=r".* returned a view tensor")


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        seq = x.shape[1]
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab=256, dim=64, heads=4, layers=4, max_seq=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(max_seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch_for(rank, step, batch=4, seq=32, vocab=256):
    """Deterministic per-rank data: a learnable pattern (next = token + 1)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    tokens = (start + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def shard(model, mesh=None, allocate_from_group=False, fully_shard=None):
    """Applies fully_shard to each block and to the root (FSDP2's usual
    wrapping): upstream's unless ``fully_shard`` is given (e.g.
    torch_fsdp_ext.fully_shard). ``allocate_from_group`` turns on
    set_allocate_memory_from_process_group_for_comm for every FSDP module."""
    from torch.distributed.fsdp import fully_shard as upstream_fully_shard

    fully_shard = fully_shard or upstream_fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if allocate_from_group:
        for module in model.modules():
            if hasattr(module, "set_allocate_memory_from_process_group_for_comm"):
                module.set_allocate_memory_from_process_group_for_comm(True)
    return model
