"""The hardware of the ranks that train, measured on them: what the cost model prices plans with by default on
the torch backend (`hardware=None`, or `hardware="measure"`).

In a second or two, on the process group the plan will run on: per mesh axis (its sub-group) and collective
kind (all-reduce, all-gather, reduce-scatter, all-to-all) the median time of a call at a few sizes, fitted as
latency + bytes / bandwidth with the bytes `lower` counts for that collective (each call's fixed cost is what
gloo, and NCCL for small messages, charges most: `docs/performance.md`); a matmul's FLOP/s, an elementwise
op's bytes/s, and one small op's time (the engine's floor per op). Every rank measures; the slowest rank's
figures are every rank's (one `Hardware` for all). The result is a `Hardware` cached as JSON under
$XDG_CACHE_HOME/partir_torch/hardware, keyed by the machine (host, CPU or GPU model, torch, process-group
backend), the world size and the mesh: a calibration of another machine or world size is never used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist

from partir_torch import _compat
from partir_torch.backends.distributed.runtime import RankMesh
from partir_torch.cost.hardware import Hardware, hardware

log = logging.getLogger(__name__)
SIZES = (1 << 12, 1 << 16, 1 << 20)  # bytes a device sends per call (4 KiB, 64 KiB, 1 MiB)
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


def fingerprint(rm: RankMesh) -> str:
    """The machine, world size and mesh a calibration is valid for."""
    device = torch.cuda.get_device_name(rm.device) if rm.device.type == "cuda" else platform.processor() or \
        platform.machine()
    key = {"host": platform.node(), "device": device, "cpus": os.cpu_count(), "torch": torch.__version__,
           "backend": dist.get_backend(), "world": rm.world, "mesh": list(rm.mesh.axes)}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _path(key: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "partir_torch" / "hardware" / f"{key}.json"


def cached_path(rm: RankMesh) -> Path:
    """Where these ranks' calibration is cached."""
    return _path(fingerprint(rm))


def measured(rm: RankMesh, base: str = "cpu-virtual") -> Hardware:
    """The cached calibration of these ranks, or a new one (measured now, cached); every rank holds the same."""
    key = fingerprint(rm)
    path = _path(key)
    box = [None]
    if rm.rank == 0 and path.is_file():
        try:
            box[0] = json.loads(path.read_text())
        except (OSError, ValueError):
            box[0] = None
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        fig = box[0]
        return Hardware(**{**fig, "links": tuple(tuple(x) for x in fig["links"])})
    t0 = time.perf_counter()
    hw = calibrate(rm, base, name=f"measured-{key}")
    if rm.rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(asdict(hw), indent=1))
        except OSError as e:
            log.warning("partir_torch: the calibration could not be cached at %s (%s)", path, e)
        log.warning("partir_torch: measured this machine's collectives and compute on %d ranks in %.1f s (%s); "
                    "the plan is priced with them (hardware= a preset name prices it otherwise)", rm.world,
                    time.perf_counter() - t0, path)
    return hw


def calibrate(rm: RankMesh, base: str = "cpu-virtual", *, name: str = "measured", repeat: int = 5) -> Hardware:
    """Measure now (module docstring); `base` gives the figures not measured (memory, DCN, fast-domain size)."""
    links = []
    for axis, n in rm.mesh.axes:
        if n == 1:
            continue
        for kind in KINDS:
            points = [(nbytes, _time_collective(rm, axis, kind, nbytes, repeat)) for nbytes in SIZES]
            alpha, beta = _fit(points)
            links.append((axis, kind, alpha, beta))
    flops, bw, floor = _compute(rm.device, repeat)
    figures = torch.tensor([flops, bw, floor, *(x for _, _, a, b in links for x in (a, b))], dtype=torch.float64)
    # the slowest rank's figures: the least FLOP/s and bandwidth, the largest latencies
    slow = figures.clone()
    slow[:2] *= -1
    slow[4::2] *= -1
    dist.all_reduce(slow, op=dist.ReduceOp.MAX)
    slow[:2] *= -1
    slow[4::2] *= -1
    flops, bw, floor = slow[:3].tolist()
    links = [(axis, kind, float(slow[3 + 2 * i]), float(slow[4 + 2 * i])) for i, (axis, kind, _, _) in
             enumerate(links)]
    fast = next((link for link in links if link[1] == "all-reduce"), None)
    preset = hardware(base)
    return replace(preset, name=name, peak_flops_fp32=flops, peak_flops_bf16=flops, matmul_efficiency=1.0,
                   hbm_bandwidth=bw, launch_floor=floor, links=tuple(links),
                   link_latency=fast[2] if fast else preset.link_latency,
                   link_bandwidth=fast[3] if fast else preset.link_bandwidth)


def _time_collective(rm: RankMesh, axis: str, kind: str, nbytes: int, repeat: int) -> float:
    """Median seconds of one call of `kind` over `axis`'s group, moving `nbytes` as `lower` counts them."""
    name, n = rm.groups[axis].group_name, rm.mesh.size(axis)
    numel = max(n, nbytes // 4 // n * n)
    x = torch.ones(numel, dtype=torch.float32, device=rm.device)
    if kind == "all-gather":
        x = x[: numel // n]  # (`lower` counts an all-gather's output)
    ops = _compat.c10d_functional  # (the ops the rank program issues)

    def once() -> None:
        if kind == "all-reduce":
            y = ops.all_reduce.default(x, "sum", name)
        elif kind == "all-gather":
            y = ops.all_gather_into_tensor.default(x, n, name)
        elif kind == "reduce-scatter":
            y = ops.reduce_scatter_tensor.default(x, "sum", n, name)
        else:
            y = ops.all_to_all_single.default(x, [numel // n] * n, [numel // n] * n, name)
        ops.wait_tensor.default(y)

    return _timed(once, rm, repeat)


def _timed(fn, rm: RankMesh, repeat: int) -> float:
    fn()  # (warm-up: the group's first call sets up its connections)
    times = []
    for _ in range(repeat):
        dist.barrier()
        if rm.device.type == "cuda":
            torch.cuda.synchronize(rm.device)
        t = time.perf_counter()
        fn()
        if rm.device.type == "cuda":
            torch.cuda.synchronize(rm.device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares latency and bandwidth of t = latency + bytes / bandwidth (both kept positive)."""
    xs, ys = [float(b) for b, _ in points], [t for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-13)
    alpha = max(my - slope * mx, min(ys) * 0.5 if slope * xs[0] >= ys[0] else ys[0] - slope * xs[0])
    return max(alpha, 1e-7), 1.0 / slope


def _compute(device: torch.device, repeat: int) -> tuple[float, float, float]:
    """(matmul FLOP/s, elementwise bytes/s, one small op's seconds) on this rank's device."""
    chain = _traced_chain()
    a = torch.randn(256, 256, device=device)
    b = torch.randn(256, 256, device=device)
    x = torch.randn(1 << 20, device=device)
    tiny = torch.randn(16, device=device)

    def med(fn) -> float:
        fn()
        ts = []
        for _ in range(repeat):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    mm = med(lambda: [a @ b for _ in range(4)]) / 4
    add = med(lambda: [x + x for _ in range(4)]) / 4
    floor = med(lambda: chain(tiny)) / 64  # an op of a traced graph, as the rank program runs its ops
    return 2 * 256**3 / mm, 3 * x.numel() * 4 / add, floor


def _chain(t: torch.Tensor) -> torch.Tensor:
    for _ in range(32):
        t = (t * 1.0001).view(-1)
    return t


def _traced_chain():
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(_chain)(torch.zeros(16))
