"""The process group and device mesh a plan runs on: `torch.distributed` as PyTorch users start it.

A rank joins the default process group (started by `torchrun`, by `launch.spawn`, or by the user), and
`connect(mesh)` builds the `init_device_mesh` mesh of the plan's axes on it, with one sub-group per axis.
Ranks are numbered row-major over the mesh's axes, as `init_device_mesh` lays them out, so a `:dcn` axis
(slow, across nodes) must be among the leading axes: under `torchrun --nnodes`, ranks are numbered node
by node. The device is what the process group offers: CUDA for NCCL, the CPU for gloo, the current
accelerator for any other backend; nothing else here names a device type.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from partir_torch.errors import PartirError
from partir_torch.ir.mesh import Mesh

START = ("start one with torchrun (`torchrun --nproc-per-node {n} your_script.py`), or from Python with "
         "`partir_torch.launch.spawn(fn, {n})` (fn(rank, world_size) runs with the process group initialized)")


class DistributedError(PartirError):
    """The process group, world size or device does not fit the plan."""


@dataclass(frozen=True)
class RankMesh:
    """This rank's place in the plan's mesh: the torch `DeviceMesh`, its coordinate, each axis's group."""

    mesh: Mesh
    device_mesh: object  # torch.distributed.device_mesh.DeviceMesh
    coord: dict[str, int]
    groups: dict[str, object]  # axis -> ProcessGroup
    device: torch.device
    rank: int
    world: int


def start_from_env() -> bool:
    """Join the default process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) when
    there is one and the group is not started yet; False when there is none."""
    if dist.is_initialized():
        return True
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return False
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    return True


def device_of_group() -> torch.device:
    """The device the default process group's collectives run on."""
    backend = dist.get_backend()
    if backend == "nccl":
        if not torch.cuda.is_available():
            found = ["cpu"] + ([torch.accelerator.current_accelerator().type] if hasattr(torch, "accelerator")
                               and torch.accelerator.current_accelerator() is not None else [])
            raise DistributedError(f"the process group runs NCCL, which needs CUDA devices, but none is found "
                                   f"(devices here: {', '.join(found)}); start it with gloo (CPU), or on a GPU "
                                   "machine")
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo":
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return torch.device(acc.type, torch.accelerator.current_device_index()) if acc is not None else torch.device("cpu")


def connect(mesh: Mesh, dcn_axes=()) -> RankMesh:
    """This rank's `RankMesh` for `mesh`; the default process group must be started (or startable from the
    environment) and span exactly the mesh's devices."""
    from torch.distributed.device_mesh import init_device_mesh

    if not start_from_env():
        raise DistributedError("no torch.distributed process group: " + START.format(n=mesh.devices))
    world = dist.get_world_size()
    if world != mesh.devices:
        sizes = " x ".join(f"{n}={s}" for n, s in mesh.axes)
        raise DistributedError(f"the process group has {world} ranks but the mesh {mesh} spans {mesh.devices} "
                               f"devices ({sizes}): launch {mesh.devices} processes, or plan for a mesh of {world}")
    dcn = [a for a in mesh.names if a in set(dcn_axes)]
    if dcn and list(mesh.names[:len(dcn)]) != dcn:
        raise DistributedError(f"the :dcn axes {dcn} must come first in the mesh {mesh}: ranks are numbered node by "
                               "node, so only the leading axes span nodes; write them first")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    inner = mesh.devices // max(1, _prod(mesh.size(a) for a in dcn))
    if dcn and local and inner != local:
        raise DistributedError(f"the axes after the :dcn axes span {inner} devices, but each node runs {local} "
                               f"ranks (LOCAL_WORLD_SIZE): make the fast axes' product {local}")
    device = device_of_group()
    dm = init_device_mesh(device.type, tuple(s for _, s in mesh.axes), mesh_dim_names=mesh.names)
    coord = dict(zip(mesh.names, dm.get_coordinate()))
    return RankMesh(mesh, dm, coord, {a: dm.get_group(a) for a in mesh.names}, device, dist.get_rank(), world)


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out
