"""Hardware presets: peak FLOP/s, memory, HBM bandwidth, per-axis link bandwidth and latency.

Figures are per chip / per GPU, dense, from the vendors' public spec sheets (see `../shared/notes/hardware.md`):
- TPU v4: 275 TFLOP/s bf16, 32 GiB HBM at ~1.2 TB/s, ICI ~2400 Gbps per chip (cloud.google.com/tpu/docs/v4).
- TPU v5e: 197 TFLOP/s bf16, 16 GiB at ~0.82 TB/s, ICI ~1600 Gbps (cloud.google.com/tpu/docs/v5e).
- TPU v5p: 459 TFLOP/s bf16, 95 GiB at ~2.77 TB/s, ICI ~4800 Gbps (cloud.google.com/tpu/docs/v5p).
- TPU v6e: 918 TFLOP/s bf16, 32 GiB at ~1.64 TB/s, ICI ~3200 Gbps (cloud.google.com/tpu/docs/v6e).
- A100 80GB SXM: 312 TFLOP/s bf16, 80 GB at ~2.0 TB/s, NVLink3 600 GB/s bidirectional; IB HDR 200 Gb/s per GPU.
- H100 SXM: 989 TFLOP/s bf16, 80 GB at ~3.35 TB/s, NVLink4 900 GB/s bidirectional; IB NDR 400 Gb/s per GPU.
- H200 SXM: 989 TFLOP/s bf16, 141 GB at ~4.8 TB/s, NVLink4 900 GB/s bidirectional; IB NDR 400 Gb/s per GPU.
- cpu-virtual: the 8-device CPU mesh of tests and the demo; times mean nothing, bytes are exact. Attention
  there is plain math (torch_xla on the CPU has no flash kernel); the accelerator presets assume a flash
  kernel (cuDNN / FlashAttention on GPUs, a Pallas kernel on TPUs): `flash_attention=False` overrides.
Link bandwidth here is the one-direction bandwidth a ring collective on one mesh axis can use per device
(half of a bidirectional NVLink figure; a TPU's ICI split over its torus dimensions is approximated by the
per-chip figure / 2). fp32 peak is taken as half of bf16 on TPUs (MXU passes) and from the spec sheet on GPUs
(TF32 tensor cores). Every figure can be overridden.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from partir_torch.errors import PartirError

GB, GiB, TB = 1e9, 2**30, 1e12


class HardwareError(PartirError):
    """Unknown preset or invalid override."""


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops_bf16: float  # FLOP/s per device
    peak_flops_fp32: float
    memory: float  # bytes per device
    hbm_bandwidth: float  # bytes/s
    link_bandwidth: float  # bytes/s per device, one direction, fast axes (ICI / NVLink)
    link_latency: float  # s per collective step on fast axes
    dcn_bandwidth: float  # bytes/s per device across slices / nodes (DCN / InfiniBand)
    dcn_latency: float
    max_fast_devices: int  # devices one fast domain holds (a TPU slice, an NVLink node)
    matmul_efficiency: float = 0.6  # fraction of peak a large matmul reaches (documented in docs/cost-model.md)
    launch_floor: float = 2e-6  # s, the least an op costs
    # attention runs as a flash kernel (saves the log-sum-exp for the backward) or as plain math (saves the
    # [B, H, T, S] probabilities): torch_xla's SDPA has no flash kernel unless one is called explicitly
    flash_attention: bool = True
    # the engine's reduction buckets (`Options.bucket_cap`, `lower/buckets.py`): one call each, priced so
    bucket_cap: float = 25 * 2**20
    # measured on the ranks that train (`backends/distributed/calibrate.py`): per (mesh axis, collective kind)
    # (axis, kind, latency s a call, bytes/s as `lower` counts a collective's bytes), used instead of the
    # link figures' ring model for those axes
    links: tuple[tuple[str, str, float, float], ...] = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "flash_attention":
                if not isinstance(v, bool):
                    raise HardwareError(f"hardware {self.name!r}: flash_attention must be True or False, got {v!r}")
            elif f.name == "links":
                bad = [x for x in v if len(x) != 4 or not (x[2] >= 0 and x[3] > 0)]
                if bad:
                    raise HardwareError(f"hardware {self.name!r}: links are (axis, kind, latency >= 0, bytes/s > 0), "
                                        f"got {bad[:2]}")
            elif f.name != "name" and (not isinstance(v, (int, float)) or v <= 0):
                raise HardwareError(f"hardware {self.name!r}: {f.name} must be a positive number, got {v!r}")
        if self.matmul_efficiency > 1:
            raise HardwareError(
                f"hardware {self.name!r}: matmul_efficiency is a fraction of peak, got {self.matmul_efficiency}"
            )

    def peak(self, itemsize: int) -> float:
        return self.peak_flops_fp32 if itemsize >= 4 else self.peak_flops_bf16

    def link(self, axis: str, kind: str) -> tuple[float, float] | None:
        """(latency s a call, bytes/s) measured for `kind` on `axis` (None: not measured; the ring model)."""
        return next(((a, b) for ax, k, a, b in self.links if ax == axis and k == kind), None)


def _gbps(x: float) -> float:
    return x * 1e9 / 8


PRESETS: dict[str, Hardware] = {
    h.name: h
    for h in [
        Hardware("tpu-v4", 275 * TB, 137.5 * TB, 32 * GiB, 1.2 * TB, _gbps(2400) / 2, 5e-6, _gbps(100), 2e-5, 4096),
        Hardware("tpu-v5e", 197 * TB, 98.5 * TB, 16 * GiB, 0.82 * TB, _gbps(1600) / 2, 5e-6, _gbps(100), 2e-5, 256),
        Hardware("tpu-v5p", 459 * TB, 229.5 * TB, 95 * GiB, 2.77 * TB, _gbps(4800) / 2, 5e-6, _gbps(100), 2e-5, 8960),
        Hardware("tpu-v6e", 918 * TB, 459 * TB, 32 * GiB, 1.64 * TB, _gbps(3200) / 2, 5e-6, _gbps(100), 2e-5, 256),
        Hardware("a100-80gb", 312 * TB, 156 * TB, 80 * GB, 2.0 * TB, 300 * GB, 8e-6, _gbps(200), 2e-5, 8),
        Hardware("h100-sxm", 989 * TB, 494.5 * TB, 80 * GB, 3.35 * TB, 450 * GB, 8e-6, _gbps(400), 2e-5, 8),
        Hardware("h200-sxm", 989 * TB, 494.5 * TB, 141 * GB, 4.8 * TB, 450 * GB, 8e-6, _gbps(400), 2e-5, 8),
        Hardware("cpu-virtual", 1e11, 1e11, 16 * GiB, 2e10, 1e10, 1e-5, 1e9, 1e-4, 64, flash_attention=False),
    ]
}


# accelerator names (CUDA's device name, TPU versions) -> preset: the first key found in the name
_BY_NAME = (("H200", "h200-sxm"), ("H100", "h100-sxm"), ("A100", "a100-80gb"), ("v6e", "tpu-v6e"), ("v5p", "tpu-v5p"),
            ("v5e", "tpu-v5e"), ("v5 lite", "tpu-v5e"), ("v5litepod", "tpu-v5e"), ("v4", "tpu-v4"))


def preset_for(device_name: str) -> str | None:
    """The preset of an accelerator by its name (`NVIDIA H100 80GB HBM3`, `TPU v5p`), or None.

    >>> preset_for("NVIDIA H100 80GB HBM3"), preset_for("Tesla T4")
    ('h100-sxm', None)
    """
    low = device_name.lower()
    return next((p for key, p in _BY_NAME if key.lower() in low), None)


def check_mesh(hw: Hardware, axes: dict[str, int] | list[tuple[str, int]], dcn_axes=frozenset()) -> None:
    """The axes not marked as crossing slices / nodes form one fast domain (a TPU slice, an NVLink node): their
    devices must fit in one (`max_fast_devices`), or the link figures of the fast axes would not hold."""
    items = list(axes.items()) if isinstance(axes, dict) else list(axes)
    fast = [(a, n) for a, n in items if a not in dcn_axes]
    total = 1
    for _, n in fast:
        total *= n
    if total > hw.max_fast_devices:
        desc = " x ".join(f"{a}={n}" for a, n in fast)
        raise HardwareError(
            f"the mesh axes {desc} span {total} devices over {hw.name}'s fast links, but one fast domain (a TPU "
            f"slice / an NVLink node) holds {hw.max_fast_devices}; mark the axes that cross slices or nodes, "
            f"e.g. `{fast[0][0]}={fast[0][1]}:dcn`, or override max_fast_devices")


def hardware(name: str | Hardware, **overrides: float) -> Hardware:
    """A preset by name, with any figure overridden (`memory=16 * 2**30`, `link_bandwidth=...`)."""
    hw = name if isinstance(name, Hardware) else PRESETS.get(name)
    if name == "measure":
        raise HardwareError("hardware='measure' is measured on the ranks of a torch.distributed job, by "
                            "auto_shard(..., backend='torch') (its default) or `partir-torch calibrate --nproc N "
                            "--mesh M`: start the ranks (torchrun --nproc-per-node N script.py, or "
                            "partir_torch.launch.spawn(fn, N)), or name a preset here (cpu-virtual, h100-sxm, ...)")
    if hw is None:
        raise HardwareError(f"unknown hardware preset {name!r}; presets: {', '.join(PRESETS)}")
    known = {f.name for f in fields(Hardware)} - {"name"}
    bad = set(overrides) - known
    if bad:
        raise HardwareError(f"unknown hardware figure(s) {sorted(bad)}; figures: {sorted(known)}")
    return replace(hw, **overrides) if overrides else hw


def parse_bytes(value: float | int | str | None) -> float | None:
    """A memory size as users write it: `16GiB`, `80GB`, `512MiB`, or a number of bytes."""
    if value is None or isinstance(value, int | float):
        return value
    import re

    m = re.fullmatch(r"\s*([\d.]+)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*", str(value))
    if not m:
        raise PartirError(f"cannot read memory size {value!r}; write e.g. 16GiB or 80GB")
    mult = {"B": 1, None: 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 1e3, "MB": 1e6,
            "GB": 1e9, "TB": 1e12}[m.group(2)]
    return float(m.group(1)) * mult


def format_bytes(n: float) -> str:
    """`123 B`, `45.6 KiB`, `7.8 MiB`, `1.23 GiB`: sizes as people read them, tiny or large."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}" if unit == "GiB" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
