"""Engine bugs found while verifying plans, pinned as they are (strict xfail: a torch_xla that fixes one
turns its test red, and the entry goes). Each is a plain torch_xla program, without partir_torch."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.xla


def _moe_experts(w_in_spec: tuple, w_out_spec: tuple) -> float:
    """max |XLA - CPU| of an MoE layer's expert computation (dispatch einsum, two bmm, combine einsum) with the
    stacked expert weights sharded as given on a (2, 2, 2) mesh."""
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs

    mesh = xs.Mesh(np.arange(8), (2, 2, 2), ("batch", "model", "x"))
    g = torch.Generator().manual_seed(0)
    t, e, c, d, f = 64, 4, 40, 32, 64
    x = torch.randn(t, d, generator=g)
    dispatch = (torch.rand(t, e, c, generator=g) < 0.05).float()
    combine = dispatch * torch.rand(t, e, c, generator=g)
    w_in, w_out = torch.randn(e, d, f, generator=g) * 0.1, torch.randn(e, f, d, generator=g) * 0.1

    def experts(x, dispatch, combine, w_in, w_out):
        h = torch.nn.functional.gelu(torch.bmm(torch.einsum("tec,td->ecd", dispatch, x), w_in), approximate="tanh")
        return torch.einsum("tec,ecd->td", combine, torch.bmm(h, w_out))

    ref = experts(x, dispatch, combine, w_in, w_out)
    dev = torch_xla.device()
    xx, dd, cc, wi, wo = (a.to(dev) for a in (x, dispatch, combine, w_in, w_out))
    xs.mark_sharding(wi, mesh, w_in_spec)
    xs.mark_sharding(wo, mesh, w_out_spec)
    out = experts(xx, dd, cc, wi, wo)
    torch_xla.sync()
    return (out.cpu() - ref).abs().max().item()


def test_moe_experts_with_these_weight_shardings_compute_what_cpu_computes():
    """The control for the bug below: the same program, w_out as there, w_in's contraction dim not tiled."""
    assert _moe_experts(("model", None, None), (("model", "batch"), None, "x")) < 1e-5


@pytest.mark.xfail(strict=True, reason="torch_xla 2.9 SPMD miscomputes: w_in [E, D, F] with D tiled over two axes "
                   "('batch', 'x'; also ('x', 'batch') on other data) and w_out [E, F, D] with E tiled ('model', "
                   "'batch') and D on 'x' give a wrong result (found on a searched "
                   "tiny-moe plan on {batch:2, model:2, x:2}; docs/apply.md)")
def test_moe_experts_with_a_weight_tiled_batch_then_x_compute_what_cpu_computes():
    assert _moe_experts(("model", ("batch", "x"), None), (("model", "batch"), None, "x")) < 1e-5


def _send_by_shards(shape: tuple[int, ...], spec: tuple) -> bool:
    """Is a host tensor sent to the device by shards (`xm.send_cpu_data_to_device` with a sharding) on a (2, 2, 2)
    mesh read back equal?"""
    import numpy as np
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs

    mesh = xs.Mesh(np.arange(8), (2, 2, 2), ("batch", "model", "x"))
    t = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
    return torch.equal(xm.send_cpu_data_to_device([t], torch_xla.device(), xs.ShardingSpec(mesh, spec))[0].cpu(), t)


def test_a_tensor_tiled_on_some_dims_or_over_every_axis_is_sent_by_shards():
    """The control for the bug below."""
    assert _send_by_shards((8, 4, 2), ("x", None, "batch")) and _send_by_shards((8, 4), (("batch", "model"), "x"))


@pytest.mark.xfail(strict=True, raises=IndexError, reason="torch_xla 2.9 cannot send by shards a tensor tiled on "
                   "every dim and replicated over another mesh axis ('too many indices'; found on searched tiny-unet "
                   "and tiny-gns plans on {batch:2, model:2, x:2}); backends/xla moves such a tensor whole first")
def test_a_tensor_tiled_on_every_dim_and_replicated_over_an_axis_is_sent_by_shards():
    assert _send_by_shards((8, 4), ("x", "batch"))


@pytest.mark.xfail(strict=True, raises=ValueError, reason="torch_xla 2.9 builds the sharding of a rank-6 tensor "
                   "with repeated devices ('device 0 is not unique in tile assignment'); the backend leaves such "
                   "tensors to GSPMD (`backends/xla/runtime.MAX_RANK`)")
def test_a_rank_6_tensor_can_be_annotated():
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs

    mesh = xs.Mesh(np.arange(8), (2, 4), ("batch", "model"))
    z = torch.ones(4, 4, 4, 4, 4, 4).to(torch_xla.device()) * 2
    xs.mark_sharding(z, mesh, ("batch",) + (None,) * 5)
    torch_xla.sync()
    assert z.sum().item() == 2 * 4 ** 6


@pytest.mark.xfail(strict=True, reason="torch_xla 2.9 SPMD computes a grouped convolution's weight gradient wrongly "
                   "when its batch is split over one mesh axis of several: it all-reduces the autodiff's "
                   "batch_group_count convolution over every device, so the gradient is the idle axes' size "
                   "times the true one; the backend runs such convolutions its own way "
                   "(`backends/xla/lowerings._GroupedConv`, one plain convolution per group)")
@pytest.mark.parametrize("groups", [2, 16])
def test_a_grouped_convolution_with_a_split_batch_has_the_right_weight_gradient(groups):
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs

    mesh = xs.Mesh(np.arange(8), (2, 4), ("batch", "model"))
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(16, 16, 3, padding=1, groups=groups, bias=False)
    x = torch.randn(4, 16, 8, 8)
    conv(x).square().mean().backward()
    ref, conv.weight.grad = conv.weight.grad, None
    conv = conv.to(torch_xla.device())
    xd = x.to(torch_xla.device())
    xs.mark_sharding(xd, mesh, ("batch", None, None, None))
    conv(xd).square().mean().backward()
    torch_xla.sync()
    torch.testing.assert_close(conv.weight.grad.cpu(), ref)


def _manual_collective(kind: str) -> torch.Tensor:
    """One collective over `model` on a (2, 4) mesh inside a manual-sharding region (each device its [4, 3] rows
    of a [32, 3] tensor, as a per-rank program would hold them), the result read back whole. A manual region
    is how XLA could run a plan's own per-rank program and collectives instead of GSPMD's partitioning."""
    import numpy as np
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs

    mesh = xs.Mesh(np.arange(8), (2, 4), ("batch", "model"))
    groups, spec = [[0, 1, 2, 3], [4, 5, 6, 7]], (("batch", "model"), None)
    x = torch.arange(96, dtype=torch.float32).reshape(32, 3)
    local = xs.enable_manual_sharding(x.to(torch_xla.device()), spec, mesh=mesh).global_tensor
    if kind == "all-gather":
        y, rows = xm.all_gather(local, 0, groups=groups, pin_layout=False, channel_id=1,
                                use_global_device_ids=True), 128
    elif kind == "reduce-scatter":
        y, rows = torch_xla._XLAC._xla_spmd_reduce_scatter(xm.REDUCE_SUM, local, 1.0, 0, 4, groups), 8
    else:  # (xm.all_to_all takes no channel id nor global device ids)
        y, rows = xm.all_to_all(local, 0, 0, 4, groups=groups, pin_layout=False), 32
    return xs.disable_manual_sharding(y, spec, (rows, 3), mesh=mesh).global_tensor.cpu()


def test_a_manual_region_runs_all_gather_and_reduce_scatter_over_a_mesh_axis():
    """The control for the bug below: what a per-rank program needs besides all-reduce runs in a manual region."""
    x = torch.arange(96, dtype=torch.float32).reshape(8, 4, 3)  # [device, row, col]
    gathered = _manual_collective("all-gather").reshape(8, 16, 3)
    assert torch.equal(gathered[0], x[:4].reshape(16, 3)) and torch.equal(gathered[7], x[4:].reshape(16, 3))
    summed = _manual_collective("reduce-scatter").reshape(8, 3)  # device d: row d % 4 of its group's sum
    assert torch.equal(summed[1], x[:4, 1].sum(0)) and torch.equal(summed[6], x[4:, 2].sum(0))


@pytest.mark.xfail(strict=True, raises=RuntimeError, reason="torch_xla 2.9 emits a manual region's all-to-all "
                   "without a channel id or global device ids, which XLA refuses at run time ('0 <= replica_id && "
                   "replica_id < replica_count 1 1'): so XLA cannot run a plan's own per-rank program (every plan "
                   "that reads a tile in chunks or dispatches tokens has an all-to-all) and GSPMD partitions the "
                   "step its own way instead (docs/benchmarks.md: the bytes it moves beside the plan's)")
def test_a_manual_region_runs_an_all_to_all_over_a_mesh_axis():
    x = torch.arange(96, dtype=torch.float32).reshape(8, 4, 3)
    exchanged = _manual_collective("all-to-all").reshape(8, 4, 3)
    assert torch.equal(exchanged[1], x[:4, 1])  # device 1 gets row 1 of each device of its group
