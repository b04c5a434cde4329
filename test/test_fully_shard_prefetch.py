"""Order of FSDP's unshard / reshard / post_backward events, recorded with
``torch_fsdp_ext.trace_fsdp_events()`` (and, to verify the expectations, with
an equivalent recorder around upstream FSDP2's parameter groups).

Recording conventions (fsdp2-runtime.md section 4.3): "unshard" is recorded
when a group's unshard is called with no all-gather pending and the group not
already unsharded, tagged with the group's training state at call time (so
prefetches carry FORWARD / PRE_BACKWARD); "reshard" for every call except
forward-state calls on a group that does not reshard after forward;
"post_backward" after it returns, with the state then (POST_BACKWARD).

Model: TinyLM (token ids in, so the root's post_backward only runs in the
final callback), ``fully_shard`` on each block ``layers.i`` and on the root
(FQN ""). What is checked:
1. forward: root unshard first, then the blocks in order; reshards follow
   each block's forward when it reshards after forward, the root's last;
2. backward, default prefetch: each block prefetches the block before it
   ahead of its own post_backward; the root's unshard first (only if it
   resharded after forward) and its post_backward last; for True, False,
   None and 2 (on 4 ranks), over 3 iterations with an optimizer step;
3. two forwards before one backward: the backward pattern twice, the root's
   post_backward once at the very end;
4. a module unused in one backward (two heads, two backwards, the first with
   ``set_is_last_backward(False)``): the mistargeted prefetch and the final
   callback's post_backwards in module pre-order;
5. explicit forward prefetch (k = 1, 2 blocks ahead);
6. explicit backward prefetch (k = 1, 2 blocks behind);
7. activation checkpointing (torch.utils.checkpoint around each block call,
   or inside each block) gives the same event sequences as none;
8. grouped ``fully_shard([a, b])`` modules appear as "a, b".
"""

import pytest
import torch
import torch.nn as nn

from conftest import get_pool
from fsdp_testing import (
    IMPLS,
    DoubleLinear,
    TinyLM,
    fsdp_api,
    lm_batch,
    lm_loss,
    plain_events,
    requires_upstream,
    shard_lm,
)

F_, PB_, POST_ = "FORWARD", "PRE_BACKWARD", "POST_BACKWARD"


def U(fqn, state):
    return ("unshard", fqn, state)


def R(fqn, state):
    return ("reshard", fqn, state)


def PB(fqn):
    return ("post_backward", fqn, POST_)


def layer(i):
    return f"layers.{i}"


# --------------------------------------------------------------------------
# Expected sequences for the default (implicit) prefetching


def _reshards(raf):
    """(blocks reshard after forward, root reshards after forward)."""
    blocks = raf is not False  # None means True for non-root modules
    root = raf is not False and raf is not None
    return blocks, root


def expected_forward(n, raf, first=True):
    """One forward. ``first``: parameters start sharded; otherwise they are
    as the previous forward left them."""
    blocks, root = _reshards(raf)
    events = []
    if first or root:
        events.append(U("", F_))
    for i in range(n):
        if first or blocks:
            events.append(U(layer(i), F_))
        if blocks:
            events.append(R(layer(i), F_))
    if root:
        events.append(R("", F_))
    return events


def expected_backward_round(n, blocks_sharded):
    """The blocks' part of a backward: the last block's unshard, then each
    block prefetches the one before it ahead of its own post_backward.
    ``blocks_sharded``: whether the blocks start this round sharded (False
    only in a first round after a forward that kept them unsharded)."""
    events = []
    if blocks_sharded:
        events.append(U(layer(n - 1), PB_))
    for i in range(n - 1, -1, -1):
        if blocks_sharded and i > 0:
            events.append(U(layer(i - 1), PB_))
        events += [R(layer(i), POST_), PB(layer(i))]
    return events


def expected_backward(n, raf, forwards=1):
    """A backward over ``forwards`` forwards of the whole model."""
    blocks, root = _reshards(raf)
    events = [U("", PB_)] if root else []
    events += expected_backward_round(n, blocks)
    for _ in range(forwards - 1):
        # The previous round's post_backwards resharded every block, so these
        # unshards are real even when nothing resharded after forward.
        events += expected_backward_round(n, True)
    # The root's post_backward: its input (token ids) needs no gradient, so
    # it runs in the final callback, after everything else.
    return events + [R("", POST_), PB("")]


def only(kinds, events):
    return [e for e in events if e[0] in kinds]


UNSHARD_AND_POST_BACKWARD = ("unshard", "post_backward")


def check_expected_builders():
    """The builders reproduce the seed's literal sequences (3 blocks)."""
    assert only(UNSHARD_AND_POST_BACKWARD, expected_forward(3, True)) == [
        U("", F_), U("layers.0", F_), U("layers.1", F_), U("layers.2", F_)]
    assert only(UNSHARD_AND_POST_BACKWARD, expected_backward(3, True)) == [
        U("", PB_), U("layers.2", PB_), U("layers.1", PB_), PB("layers.2"),
        U("layers.0", PB_), PB("layers.1"), PB("layers.0"), PB("")]
    assert only(UNSHARD_AND_POST_BACKWARD, expected_backward(3, None)) == [
        U("layers.2", PB_), U("layers.1", PB_), PB("layers.2"),
        U("layers.0", PB_), PB("layers.1"), PB("layers.0"), PB("")]
    assert only(UNSHARD_AND_POST_BACKWARD, expected_backward(3, False)) == [
        PB("layers.2"), PB("layers.1"), PB("layers.0"), PB("")]
    assert only(UNSHARD_AND_POST_BACKWARD, expected_backward(3, False, forwards=2)) == [
        PB("layers.2"), PB("layers.1"), PB("layers.0"),
        U("layers.2", PB_), U("layers.1", PB_), PB("layers.2"),
        U("layers.0", PB_), PB("layers.1"), PB("layers.0"), PB("")]


def test_expected_sequences_match_the_spec():
    check_expected_builders()


# --------------------------------------------------------------------------
# Recording


def _traced(api, fn):
    """Runs ``fn()`` under the implementation's recorder; returns plain
    ``(event, fqn, state name)`` tuples."""
    with api.trace() as events:
        fn()
        recorded = list(events)
    if api.name == "ours":
        import torch_fsdp_ext

        for ev in recorded:
            assert type(ev).__name__ == "FSDPEvent", type(ev)
            assert ev._fields == ("event", "module_fqn", "training_state"), ev._fields
            assert isinstance(ev.training_state, torch_fsdp_ext.TrainingState), ev
    return plain_events(recorded)


def _lm(api, n_layers, raf, ac=None):
    torch.manual_seed(0)
    model = TinyLM(n_layers=n_layers, ac=ac)
    shard_lm(model, api, reshard_after_forward=raf)
    return model


def check_default_order(ctx, impl, raf, ac, iterations=3):
    api = fsdp_api(impl)
    n = 3
    model = _lm(api, n, raf, ac)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    per_iteration = []
    for it in range(iterations):
        tokens, targets = lm_batch(ctx.rank, it)
        box = {}
        forward = _traced(api, lambda: box.setdefault("loss", lm_loss(model(tokens), targets)))
        assert forward == expected_forward(n, raf), (it, forward)
        backward = _traced(api, lambda: box["loss"].backward())
        assert backward == expected_backward(n, raf), (it, backward)
        per_iteration.append((forward, backward))
        optim.step()
        optim.zero_grad(set_to_none=(it % 2 == 0))
    return per_iteration


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ws,raf", [(1, True), (2, True), (2, False), (2, None), (4, 2)],
                         ids=lambda v: repr(v))
def test_default_forward_backward_order(ws, raf, impl):
    get_pool(ws).run(check_default_order, impl, raf, None)


def check_multi_forward(ctx, impl, raf, ac):
    api = fsdp_api(impl)
    n = 3
    model = _lm(api, n, raf, ac)
    tokens, targets = lm_batch(ctx.rank, 0)
    other_tokens, other_targets = lm_batch(ctx.rank, 1)
    box = {}

    def two_forwards():
        box["loss1"] = lm_loss(model(tokens), targets)
        box["loss2"] = lm_loss(model(other_tokens), other_targets)

    forward = _traced(api, two_forwards)
    assert forward == expected_forward(n, raf) + expected_forward(n, raf, first=False), forward
    backward = _traced(api, lambda: (box["loss1"] + box["loss2"]).backward())
    assert backward == expected_backward(n, raf, forwards=2), backward
    return forward, backward


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("raf", [True, False, None], ids=repr)
def test_multi_forward_order(raf, impl):
    get_pool(2).run(check_multi_forward, impl, raf, None)


def check_unused_in_backward(ctx, impl):
    """Sequential(Linear "0", DoubleLinear "1" {lin1, lin2}); the root has no
    parameters of its own (so no events). Backward through lin2's output
    only, then through lin1's."""
    api = fsdp_api(impl)
    torch.manual_seed(0)
    dim = 8
    model = nn.Sequential(nn.Linear(dim, dim), DoubleLinear(dim))
    api.fully_shard(model[0])
    api.fully_shard(model[1].lin1)
    api.fully_shard(model[1].lin2)
    api.fully_shard(model)
    x = torch.randn(4, dim)
    box = {}

    def forward():
        box["out1"], box["out2"] = model(x)

    events = _traced(api, forward)
    assert events == [
        U("0", F_), R("0", F_),
        U("1.lin1", F_), R("1.lin1", F_),
        U("1.lin2", F_), R("1.lin2", F_),
    ], events

    model.set_is_last_backward(False)
    events = _traced(api, lambda: box["out2"].sum().backward(retain_graph=True))
    assert events == [
        U("1.lin2", PB_),
        # lin2 prefetches the module that ran forward just before it: lin1,
        # which this backward does not use (a mistargeted prefetch).
        U("1.lin1", PB_),
        R("1.lin2", POST_), PB("1.lin2"),
        U("0", PB_),
        # Final callback, in module pre-order: "0" (its input needs no grad)
        # and lin1 (unused; its pending all-gather stays pending).
        R("0", POST_), PB("0"),
        R("1.lin1", POST_), PB("1.lin1"),
    ], events

    model.set_is_last_backward(True)
    events = _traced(api, lambda: box["out1"].sum().backward())
    assert events == [
        # lin1's own unshard finds the earlier prefetch pending (no record);
        # it prefetches "0".
        U("0", PB_),
        R("1.lin1", POST_), PB("1.lin1"),
        R("0", POST_), PB("0"),
        # lin2 is unused this time: its post_backward runs in the final callback.
        R("1.lin2", POST_), PB("1.lin2"),
    ], events

    # Gradients: every parameter got one from the backward that used it.
    for name, param in model.named_parameters():
        assert param.grad is not None, name
    return True


@pytest.mark.parametrize("impl", IMPLS)
def test_unused_in_backward_order(impl):
    get_pool(2).run(check_unused_in_backward, impl)


# --------------------------------------------------------------------------
# Explicit prefetching (4 blocks, reshard after forward, checkpointed blocks)

EXPLICIT_N = 4

# With explicit forward prefetching the backward keeps the default pattern.
DEFAULT_BACKWARD_4 = [
    U("", PB_),
    U("layers.3", PB_),
    U("layers.2", PB_), R("layers.3", POST_), PB("layers.3"),
    U("layers.1", PB_), R("layers.2", POST_), PB("layers.2"),
    U("layers.0", PB_), R("layers.1", POST_), PB("layers.1"),
    R("layers.0", POST_), PB("layers.0"),
    R("", POST_), PB(""),
]

FORWARD_PREFETCH = {
    1: [
        U("", F_),
        U("layers.0", F_),
        U("layers.1", F_),  # prefetched by layers.0
        R("layers.0", F_),
        U("layers.2", F_),  # prefetched by layers.1
        R("layers.1", F_),
        U("layers.3", F_),  # prefetched by layers.2
        R("layers.2", F_),
        R("layers.3", F_),
        R("", F_),
    ],
    2: [
        U("", F_),
        U("layers.0", F_),
        U("layers.1", F_), U("layers.2", F_),  # prefetched by layers.0
        R("layers.0", F_),
        U("layers.3", F_),  # layers.1 prefetches 2 (pending) and 3
        R("layers.1", F_),
        R("layers.2", F_),
        R("layers.3", F_),
        R("", F_),
    ],
}

DEFAULT_FORWARD_4 = [U("", F_)] + [
    e for i in range(EXPLICIT_N) for e in (U(layer(i), F_), R(layer(i), F_))
] + [R("", F_)]

BACKWARD_PREFETCH = {
    # One block behind: the same as the default.
    1: DEFAULT_BACKWARD_4,
    2: [
        U("", PB_),
        U("layers.3", PB_),  # the root's default prefetch
        U("layers.2", PB_), U("layers.1", PB_),  # layers.3's list
        R("layers.3", POST_), PB("layers.3"),
        U("layers.0", PB_),  # layers.2's list: 1 (pending) and 0
        R("layers.2", POST_), PB("layers.2"),
        R("layers.1", POST_), PB("layers.1"),
        R("layers.0", POST_), PB("layers.0"),
        R("", POST_), PB(""),
    ],
}


def check_explicit_prefetch(ctx, impl, direction, k, ac):
    api = fsdp_api(impl)
    model = _lm(api, EXPLICIT_N, True, ac)
    layers = list(model.layers)
    for i, block in enumerate(layers):
        if direction == "forward":
            targets = layers[i + 1:i + 1 + k]
            if targets:
                block.set_modules_to_forward_prefetch(targets)
        else:
            targets = [layers[i - j] for j in range(1, k + 1) if i - j >= 0]
            if i >= k:
                block.set_modules_to_backward_prefetch(targets)
    if direction == "forward":
        expected_fwd, expected_bwd = FORWARD_PREFETCH[k], DEFAULT_BACKWARD_4
    else:
        expected_fwd, expected_bwd = DEFAULT_FORWARD_4, BACKWARD_PREFETCH[k]
    for it in range(2):
        tokens, targets = lm_batch(ctx.rank, it)
        box = {}
        forward = _traced(api, lambda: box.setdefault("loss", lm_loss(model(tokens), targets)))
        assert forward == expected_fwd, (it, forward)
        backward = _traced(api, lambda: box["loss"].backward())
        assert backward == expected_bwd, (it, backward)
    return True


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_explicit_prefetch_order(direction, k, impl):
    get_pool(2).run(check_explicit_prefetch, impl, direction, k, "outer")


# --------------------------------------------------------------------------
# Activation checkpointing changes nothing


def check_checkpointing_same_events(ctx, impl, raf):
    """Full event sequences (default prefetch, one forward/backward; two
    forwards/backward) are identical with checkpointing around each block
    call, inside each block, and without."""
    results = {}
    for ac in (None, "outer", "inner"):
        results[ac] = (check_default_order(ctx, impl, raf, ac, iterations=2),
                       check_multi_forward(ctx, impl, raf, ac))
    assert results["outer"] == results[None]
    assert results["inner"] == results[None]
    return True


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("raf", [True, False, None], ids=repr)
def test_activation_checkpointing_same_events(raf, impl):
    get_pool(2).run(check_checkpointing_same_events, impl, raf)


def check_explicit_prefetch_without_checkpointing(ctx, impl):
    for direction in ("forward", "backward"):
        for k in (1, 2):
            check_explicit_prefetch(ctx, impl, direction, k, None)
    return True


@pytest.mark.parametrize("impl", IMPLS)
def test_explicit_prefetch_same_without_checkpointing(impl):
    get_pool(2).run(check_explicit_prefetch_without_checkpointing, impl)


# --------------------------------------------------------------------------
# Grouped modules


def check_grouped_fqns(ctx, impl):
    api = fsdp_api(impl)
    torch.manual_seed(0)
    model = TinyLM(n_layers=2)
    api.fully_shard([model.tok_embeddings, model.pos_embeddings])
    for block in model.layers:
        api.fully_shard(block)
    api.fully_shard([model.norm, model.output])
    api.fully_shard(model)  # no parameters of its own left: no events
    tokens, targets = lm_batch(ctx.rank, 0)
    box = {}
    forward = _traced(api, lambda: box.setdefault("loss", lm_loss(model(tokens), targets)))
    assert only(("unshard",), forward) == [
        U("tok_embeddings, pos_embeddings", F_),
        U("layers.0", F_),
        U("layers.1", F_),
        U("norm, output", F_),
    ], forward
    backward = _traced(api, lambda: box["loss"].backward())
    post_backwards = [fqn for event, fqn, _ in backward if event == "post_backward"]
    assert sorted(post_backwards) == sorted(
        ["tok_embeddings, pos_embeddings", "layers.0", "layers.1", "norm, output"]), backward
    assert post_backwards[0] == "norm, output" and post_backwards[-1] == "tok_embeddings, pos_embeddings"
    return True


@pytest.mark.parametrize("impl", [
    "ours", pytest.param("upstream", marks=requires_upstream("grouped_post_backward_once"))])
def test_grouped_module_fqns(impl):
    get_pool(2).run(check_grouped_fqns, impl)
