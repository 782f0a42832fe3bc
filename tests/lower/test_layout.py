"""The walk between two shardings (`layout.walk`): every step's data is inside its axis's group (checked for
every device, statically), and it ends in the destination's layout; `lower.transitions` is its collectives."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partir_torch import models
from partir_torch.capture import capture
from partir_torch.ir import Mesh
from partir_torch.ir.sharding import Sharding
from partir_torch.lower import end_reshards, op_reshards, transitions
from partir_torch.lower.layout import Layout, walk
from tests import needs

MESH = Mesh.parse("batch=2,model=2,x=2")


def coords(mesh: Mesh) -> list[dict[str, int]]:
    return [dict(zip(mesh.names, c)) for c in itertools.product(*(range(s) for _, s in mesh.axes))]


def held(lay: Layout, shape, mesh, c) -> list[set[int]]:
    return [set(x.tolist()) for x in lay.index(mesh, shape, c)]


def feasible(steps, shape, mesh) -> str | None:
    """None when every device gets each step's elements from its own axis group (a collective) or from itself
    (a local step); else what fails."""
    for s in steps:
        if s.flat:  # a hierarchical all-reduce's part: the sum's layout throughout
            continue
        for c in coords(mesh):
            want = held(s.dst, shape, mesh, c)
            if s.kind in ("all-gather", "all-to-all"):
                members = [held(s.src, shape, mesh, {**c, s.axis: j}) for j in range(mesh.size(s.axis))]
                ok = all(any(all(e in m[d] for d, e in enumerate(elem)) for m in members)
                         for elem in itertools.product(*[sorted(w) for w in want]))
            else:
                ok = all(w <= h for w, h in zip(want, held(s.src, shape, mesh, c)))
            if not ok:
                return f"{s.kind} {s.axis}: {s.src} -> {s.dst} at {c}"
    return None


@pytest.mark.slow
def test_every_reshard_of_the_zoo_s_plans_is_a_feasible_walk():
    """DP + Megatron + ZeRO-3, FSDP before Megatron (axes out of order on a dim), random tiles."""
    from partir_torch.tactics import apply_schedule
    from tests.plans import random_plan

    checked = 0
    for name in ["tiny-gpt2", "tiny-unet", "tiny-gns", "tiny-moe"]:
        net, inputs, loss_fn = models.build(name, device="meta")
        program = capture(net, inputs, loss_fn, "adamw")
        states = [apply_schedule(program, MESH, s) for s in ("batch:BatchParallel;model:Megatron;x:ZeRO(3)",
                                                              "batch:FSDP;model:Megatron")]
        state = random_plan(program, MESH, name, n=10)
        for s in [*states, state]:
            pairs = {(program.values[v].shape, a, b) for o in s.active_ops() for v, a, b in op_reshards(s, o)}
            pairs |= {(program.values[v].shape, a, b) for v, a, b in end_reshards(s)}
            for shape, a, b in pairs:
                steps = walk(a, b, shape, 4, MESH)
                assert not any(x.kind == "relayout" for x in steps), (a, b, steps)
                if max(shape, default=1) * len(shape) < 3000:  # (the check enumerates elements)
                    assert feasible(steps, shape, MESH) is None, (shape, a, b)
                    checked += 1
    assert checked > 100


AXES = list(MESH.names)


@st.composite
def shardings(draw, rank: int = 2):
    """A sharding of a [32, 32] tensor: each axis on a dim (in a random order), partial, or unused."""
    dims: list[list[str]] = [[] for _ in range(rank)]
    partial = set()
    for a in draw(st.permutations(AXES)):
        where = draw(st.integers(-2, rank - 1))
        if where >= 0:
            dims[where].append(a)
        elif where == -1:
            partial.add(a)
    chunks = tuple((d, 2) for d in range(rank) if dims[d] and draw(st.booleans()) and len(dims[d]) == 1)
    return Sharding(tuple(tuple(d) for d in dims), frozenset(partial), chunks)


# (derandomized: the same examples on every run, CI is repeatable)
@settings(max_examples=needs.examples(300), deadline=None, derandomize=True)
@given(shardings(), shardings())
def test_a_walk_between_any_two_shardings_is_feasible_and_lands_in_the_destination(src, dst):
    dst = Sharding(dst.dims, frozenset(), dst.chunks) if src.partial < dst.partial else dst  # (no new sums)
    shape = (32, 32)  # (divides by 2 chunks of every tiling: a sum reduce-scattered onto a chunked dim)
    steps = walk(src, dst, shape, 4, MESH)
    assert [(s.kind, s.axis, s.nbytes) for s in steps if s.collective] == transitions(src, dst, shape, 4, MESH)
    assert not any(s.kind == "relayout" for s in steps), steps
    assert feasible(steps, shape, MESH) is None
    assert steps == [] or steps[-1].dst.same_place(Layout.of(dst))


@pytest.mark.parametrize(("src", "dst", "kinds"), [
    (Sharding((("batch",), ("model",))), Sharding((("model",), ("batch",))), ["all-gather", "all-to-all"]),
    (Sharding((("model", "batch"), ())), Sharding((("batch", "model"), ())), ["all-gather", "all-gather"]),
    (Sharding(((), ("model",)), chunks=((1, 2),)), Sharding(((), ("model",))), ["all-to-all"]),
    (Sharding(((), ("batch", "model")), chunks=((1, 2),)), Sharding(((), ("batch", "model"))),
     ["all-gather", "all-gather"]),
])
def test_axes_out_of_order_and_chunks_split_by_several_axes_are_gathered(src, dst, kinds):
    assert [s.kind for s in walk(src, dst, (8, 8), 4, MESH) if s.collective] == kinds
