"""Read XLA's SPMD-partitioned per-device HLO: its collectives (kind, bytes, mesh axes) and its memory.

Input: the `*after_optimizations.txt` module XLA dumps with `--xla_dump_to=DIR --xla_dump_hlo_as_text`, and
its `*memory-usage-report.txt` (buffer assignment). Plain text parsing: no torch_xla import, so the cost
model's tests can read stored dumps.

Bytes per device follow `lower.Collective`: all-reduce and all-to-all the result, all-gather the gathered
result, reduce-scatter the input (result x group size). Replica groups are mapped to mesh axes by the
row-major device layout `device = sum(coord[a] * stride[a])` that `torch_xla`'s `Mesh(np.arange(n), shape)`
uses.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
             "s64": 8, "u64": 8, "f64": 8}
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+(" + "|".join(_KINDS) + r")(-start)?\(")
_SHAPE = re.compile(r"(pred|[sufb]f?\d+)\[([\d,]*)\]")


@dataclass(frozen=True)
class HloCollective:
    kind: str
    axes: tuple[str, ...]
    bytes: int  # per device, as lower.Collective counts them
    result_bytes: int
    group_size: int
    name: str


def _shape_bytes(text: str) -> int:
    total = 0
    for dt, dims in _SHAPE.findall(text):
        if dt not in _ITEMSIZE:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * _ITEMSIZE[dt]
    return total


def _groups(line: str, n_devices: int) -> list[list[int]]:
    m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
    if m:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:  # iota form: [groups, size] <= [dims] with an optional transpose
        import numpy as np

        g, s = int(m.group(1)), int(m.group(2))
        dims = [int(x) for x in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(x) for x in m.group(4).split(",")])
        return ids.reshape(g, s).tolist()
    m = re.search(r"source_target_pairs=\{([^}]*(?:\},\{[^}]*)*)\}", line)
    if m:
        pairs = re.findall(r"\{(\d+),(\d+)\}", line)
        return [[int(a), int(b)] for a, b in pairs[:1]]
    return [list(range(n_devices))]


def _axes_of(group: list[int], mesh_axes: list[tuple[str, int]]) -> tuple[str, ...]:
    sizes = [s for _, s in mesh_axes]
    strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    varying = []
    for (name, size), stride in zip(mesh_axes, strides):
        coords = {(d // stride) % size for d in group}
        if len(coords) > 1:
            varying.append(name)
    return tuple(varying)


def read_collectives(hlo_text: str, mesh_axes: list[tuple[str, int]]) -> list[HloCollective]:
    n = math.prod(s for _, s in mesh_axes)
    out = []
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, result, kind, start = m.groups()
        rbytes = _shape_bytes(result)
        if start and kind == "all-gather":  # async start: (operand, result) tuple; keep the result
            rbytes = _shape_bytes(result.rsplit("],", 1)[-1])
        groups = _groups(line, n)
        size = len(groups[0]) if groups else 1
        nbytes = rbytes * size if kind == "reduce-scatter" else rbytes
        out.append(HloCollective(kind, _axes_of(groups[0], mesh_axes), nbytes, rbytes, size, name))
    return out


def read_memory_total(report_text: str) -> int:
    m = re.search(r"Total bytes used:\s*(\d+)", report_text)
    if not m:
        raise ValueError("no 'Total bytes used' line in the memory usage report")
    return int(m.group(1))


_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_ALLOC = re.compile(r"^allocation \d+: size ([\d.]+)(B|KiB|MiB|GiB), (.*)$", re.M)


def read_memory_breakdown(report_text: str) -> dict[str, int]:
    """XLA's buffer assignment by kind: `parameter` (entry arguments; aliased to an output or not),
    `output` (results that alias no argument), `temp` (the preallocated temporaries' heap), `thread_local`,
    `constant`. Sizes are printed rounded to 0.1 of their unit, so the parts add up to the total within 0.1 %."""
    out = {"parameter": 0, "output": 0, "temp": 0, "thread_local": 0, "constant": 0}
    for m in _ALLOC.finditer(report_text):
        size, what = float(m.group(1)) * _UNITS[m.group(2)], m.group(3)
        kind = ("parameter" if "parameter" in what else "temp" if "preallocated-temp" in what else
                "output" if "live-out" in what else "constant" if "constant" in what else "thread_local")
        out[kind] += int(size)
    return out


_ALIAS = re.compile(r"\{[\d,]*\}: \((\d+), \{[\d,]*\}")
_PARAM = re.compile(r"^\s*%([\w.\-]+) = \S+ parameter\((\d+)\)", re.M)
_COPY = re.compile(r"^\s*%([\w.\-]+) = \S+ copy\(%([\w.\-]+)\)", re.M)
_PEAK_BUF = re.compile(r"^\s+([\w.\-]+)\{[\d,]*\}: (\d+) bytes", re.M)


@dataclass(frozen=True)
class DonatedCopies:
    """XLA's copies of entry parameters that alias an output (buffers donated to an in-place update: the
    parameters and optimizer states the step updates): `count` copies in the step, `peak_bytes` of them live
    at the peak of its temporaries. torch_xla donates these buffers without saying which output each is for;
    XLA pairs donors with outputs by byte size, in parameter and output order, so most updates are paired
    with another tensor's buffer, and copy insertion copies the donor that is still read after it is
    overwritten; the step's reads then use the copy (when it is made is the scheduler's choice)."""

    count: int
    donated: int  # entry parameters that alias an output
    peak_bytes: int


def read_donated_copies(hlo_text: str, assignment_text: str | None) -> DonatedCopies:
    """`DonatedCopies` of the step's module and its buffer assignment (`*-buffer-assignment.txt`; without it,
    `peak_bytes` is 0)."""
    header = hlo_text.split("\n", 1)[0]
    m = re.search(r"input_output_alias=\{(.*)\}", header)
    donated = {int(i) for i in _ALIAS.findall(m.group(1))} if m else set()
    entry = hlo_text[hlo_text.find("\nENTRY"):]
    params = {name for name, idx in _PARAM.findall(entry) if int(idx) in donated}
    copies = {name for name, src in _COPY.findall(entry) if src in params}
    peak = 0
    if assignment_text and copies:
        at = assignment_text.find("(peak):")
        if at >= 0:
            block = assignment_text[at:].split("\n", 1)[1]
            for line in block.splitlines():
                hit = _PEAK_BUF.match(line)
                if not hit:
                    break
                if hit.group(1) in copies:
                    peak += int(hit.group(2))
    return DonatedCopies(len(copies), len(donated), peak)


def find_step_module(dump_dir: str | Path) -> tuple[Path, Path | None]:
    """The largest partitioned module in a dump (the training step), and its memory report."""
    files = sorted(Path(dump_dir).glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)
    if not files:
        raise FileNotFoundError(
            f"no *after_optimizations.txt in {dump_dir}; was XLA_FLAGS set before torch_xla started?"
        )
    hlo = files[-1]
    mem = Path(str(hlo).replace("after_optimizations.txt", "after_optimizations-memory-usage-report.txt"))
    return hlo, mem if mem.exists() else None
