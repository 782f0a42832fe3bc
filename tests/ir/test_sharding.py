"""Meshes, shardings and actions: notation, the tiling rule, and typed errors that show the values."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from partir_torch.errors import IllegalActionError, MeshError
from partir_torch.ir import Mesh, Replicate, Sharding, Tile


def test_mesh_parse_and_str():
    m = Mesh.parse("batch=2,model=4")
    assert m == Mesh.of({"batch": 2, "model": 4})
    assert str(m) == "Mesh{batch:2, model:4}" and m.devices == 8 and m.names == ("batch", "model")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("batch=2,batch=4", r"'batch' appears twice"),
        ("batch=0", r"'batch' has size 0"),
        ("batch", r"'batch' is not axis=size"),
        ("", r"empty mesh"),
    ],
)
def test_bad_meshes(text, match):
    with pytest.raises(MeshError, match=match):
        Mesh.parse(text)


def test_unknown_axis_lists_axes():
    with pytest.raises(MeshError, match=r"unknown mesh axis 'data'; this mesh has axes \['batch', 'model'\]"):
        Mesh.parse("batch=2,model=4").size("data")


def test_sharding_notation_and_spec_round_trip():
    s = Sharding.replicated(3).tile(0, "batch").tile(0, "model").tile(2, "x")
    assert str(s) == "P(('batch', 'model'), None, 'x')"
    assert s.to_spec() == [["batch", "model"], None, "x"]
    assert Sharding.from_spec(s.to_spec()) == s
    p = Sharding(((), ()), frozenset({"model"}))
    assert str(p) == "P(None, None) + sum{model}"


def test_tile_errors_show_value_shape_dim_and_sizes():
    mesh = Mesh.parse("batch=2,model=4")
    s = Sharding.replicated(2)
    with pytest.raises(IllegalActionError,
                       match=r"cannot tile h\.0\.w \[6, 8\] dim 0 \(size 6\) over 'model'.*4 \(model=4\)"):
        s.tile(0, "model", value="h.0.w", shape=(6, 8), mesh=mesh)
    t = s.tile(1, "batch", value="w", shape=(6, 8), mesh=mesh)
    with pytest.raises(IllegalActionError, match=r"axis 'batch' is already used on w \(sharding P\(None, 'batch'\)\)"):
        t.tile(0, "batch", value="w", shape=(6, 8), mesh=mesh)
    t.tile(1, "model", value="w", shape=(6, 8), mesh=mesh)  # 8 divides by batch*model = 8
    with pytest.raises(IllegalActionError,
                       match=r"cannot tile v \[6, 4\] dim 1 \(size 4\) over 'model'.*8 \(batch=2, model=4\)"):
        t.tile(1, "model", value="v", shape=(6, 4), mesh=mesh)
    with pytest.raises(IllegalActionError, match=r"rank 2; dim 2 does not exist"):
        s.tile(2, "batch", value="w")
    with pytest.raises(MeshError, match=r"unknown mesh axis 'data'"):
        s.tile(0, "data", value="w", shape=(6, 8), mesh=mesh)


@given(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=3), st.data())
def test_local_shape_times_axis_sizes_is_global_shape(dims, data):
    mesh = Mesh.parse("a=2,b=4")
    shape = tuple(d * 8 for d in dims)
    s = Sharding.replicated(len(shape))
    for axis in ("a", "b"):
        if data.draw(st.booleans()):
            s = s.tile(data.draw(st.integers(0, len(shape) - 1)), axis, shape=shape, mesh=mesh)
    local = s.local_shape(shape, mesh)
    for g, loc, axes in zip(shape, local, s.dims):
        k = 1
        for a in axes:
            k *= mesh.size(a)
        assert loc * k == g


def test_actions_are_frozen_ordered_and_readable():
    a, b = Tile("h.*.attn.c_attn.weight", 0, "model"), Replicate("inputs[0]", "model")
    assert str(a) == "tile(h.*.attn.c_attn.weight, 0, model)" and str(b) == "replicate(inputs[0], model)"
    assert sorted([Tile("b", 0, "x"), Tile("a", 1, "x")])[0].target == "a"
    assert len({a, Tile("h.*.attn.c_attn.weight", 0, "model")}) == 1
    with pytest.raises(AttributeError):
        a.dim = 1


def test_chunked_layout_reads_and_costs_an_all_to_all():
    """A dim read in n chunks (a split into n equal parts) holds as many elements as a block: blocks <-> chunks
    is an all-to-all of the local block, chunks -> replicated an all-gather."""
    from partir_torch.lower import transitions

    mesh = Mesh.parse("batch=2,model=4")
    blocks = Sharding.replicated(3).tile(0, "batch").tile(2, "model")
    chunks = Sharding(blocks.dims, chunks=((2, 3),))
    assert str(chunks) == "P('batch', None, 'model') chunks{2: 3}" and chunks != blocks
    shape = (8, 16, 96)
    local = 4 * 16 * 24 * 4
    assert transitions(blocks, chunks, shape, 4, mesh) == [("all-to-all", "model", local)]
    assert transitions(chunks, blocks, shape, 4, mesh) == [("all-to-all", "model", local)]
    assert transitions(chunks, Sharding.replicated(3).tile(0, "batch"), shape, 4, mesh) == [
        ("all-gather", "model", local * 4)]
