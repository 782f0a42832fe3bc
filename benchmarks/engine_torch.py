"""The torch backend's step beside PyTorch's own engines, on the same ranks, model, global batch and AdamW.

    .venv/bin/python benchmarks/engine_torch.py [--ranks 4] [--models tiny-gpt2 ...] [--steps 8]
        [--out benchmarks/results/engine_torch.json]        # then: --table (docs/performance.md from the JSON)

Per model, on `--ranks` gloo CPU ranks (or NCCL GPUs where there are enough), each trained `--steps` steps,
the median step after the first two:
- what a user would otherwise run: DDP; FSDP2 (`fully_shard` per block, then the root); for the models whose
  attention reads its head counts from module attributes (the zoo's Llama), torch tensor parallelism
  (`parallelize_module`, ColwiseParallel q/k/v and gate/up, RowwiseParallel o/down, torchtitan style) with
  DDP over the other axis, and FSDP2 x TP, on {2, 2};
- partir_torch running the same plans (`batch:BatchParallel` on {4}, `batch:FSDP` on {4},
  `batch:BatchParallel;model:Megatron` on {2, 2}), and the plans it searches on {4} and {2, 2} (priced with the
  ranks' own calibration, the default), also under a memory limit of 0.6 x DDP's peak per rank;
- per row: the median step, its ratio to the best baseline that fits, the predicted step (partir_torch's),
  each rank's peak memory (the largest).
Writes the JSON and, with --table, the table and plot of docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIGS = {"tiny-gpt2": {"batch": "8"}, "gpt2-small": {"layers": "2", "width": "256", "heads": "8", "vocab": "4096",
                                                       "seq": "64", "batch": "8"},
           "tiny-llama": {"batch": "8"}, "llama-small": {"layers": "2", "width": "256", "heads": "8",
                                                         "kv_heads": "4", "ffn": "512", "vocab": "4096", "seq": "64",
                                                         "batch": "8"},
           "tiny-mlp": {"batch": "16"}}
OURS = {"ours DP": ("batch=4", "batch:BatchParallel"), "ours FSDP": ("batch=4", "batch:FSDP"),
        "ours Megatron x DP": ("batch=2,model=2", "batch:BatchParallel;model:Megatron"),
        "ours searched {4}": ("batch=4", None), "ours searched {2,2}": ("batch=2,model=2", None)}
SAME = {"ours DP": "DDP", "ours FSDP": "FSDP2", "ours Megatron x DP": "TP x DP"}  # the bar: <= 1.05 x these


def _build(name: str, device):
    torch.manual_seed(0)
    if name in CONFIGS:
        from partir_torch import models

        zoo = "llama-7b" if name == "llama-small" else name
        return models.build(zoo, CONFIGS[name], device=device)
    from benchmarks.workloads.thirdparty import BUILDERS

    model, inputs, loss_fn = BUILDERS[name]()
    return model.to(device), tuple(x.to(device) for x in inputs), loss_fn


def _timed(fn, steps: int) -> tuple[float, float, float]:
    """(median step s after two, first step s, last loss)."""
    import torch.distributed as dist

    times, loss = [], 0.0
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        loss = float(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:]), times[0], loss


def _peak(fn, model, opt, dev) -> int:
    """One step's peak of this rank's tensors (parameters, states, gradients, activations)."""
    from partir_torch import _compat

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        fn()
        return torch.cuda.max_memory_allocated(dev)
    tracker = _compat.MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        fn()
    return int(sum(d.get("Total", 0) for d in tracker.get_tracker_snapshot("peak").values()))


def _blocks(model) -> list:
    return [b for m in model.modules() if isinstance(m, torch.nn.ModuleList) for b in m]


def _tp(model, mesh) -> bool:
    """torchtitan-style TP of the zoo Llama's blocks over `mesh` (False: not a model this knows)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    blocks = _blocks(model)
    if not blocks or not hasattr(blocks[0], "self_attn") or not hasattr(blocks[0].self_attn, "kv_heads"):
        return False
    n = mesh.size()
    for b in blocks:
        parallelize_module(b, mesh, {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                                     "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                                     "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                                     "mlp.down_proj": RowwiseParallel()})
        b.self_attn.heads //= n  # (the local heads: torchtitan sets n_heads // tp likewise)
        b.self_attn.kv_heads //= n
    return True


def baselines(rank: int, world: int, name: str, steps: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    out: dict = {}
    for kind in ("DDP", "FSDP2", "TP x DP", "FSDP2 x TP"):
        model, inputs, loss_fn = _build(name, dev)
        if kind in ("DDP", "FSDP2"):
            dp, n = None, world
        else:
            mesh = init_device_mesh(dev.type, (2, world // 2), mesh_dim_names=("dp", "tp"))
            if not _tp(model, mesh["tp"]):
                continue
            dp, n = mesh["dp"], 2
        if kind in ("DDP", "TP x DP"):
            model = DistributedDataParallel(model, device_mesh=dp) if dp is not None else DistributedDataParallel(
                model)
        else:
            for b in _blocks(model):
                fully_shard(b, mesh=dp) if dp is not None else fully_shard(b)
            fully_shard(model, mesh=dp) if dp is not None else fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        i = rank if dp is None else dp.get_local_rank()
        b = inputs[0].shape[0] // n
        mine = [x[i * b:(i + 1) * b] for x in inputs]

        def step(model=model, opt=opt, mine=mine, loss_fn=loss_fn):
            loss = loss_fn(model, *mine)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        med, first, loss = _timed(step, steps)
        peak = torch.tensor(_peak(step, model, opt, dev))
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        out[kind] = {"step_s": med, "first_s": first, "loss": loss, "peak": int(peak)}
    return out


def ours(rank: int, world: int, name: str, steps: int, limit: float | None) -> dict:
    import torch.distributed as dist

    import partir_torch
    from partir_torch.backends.distributed import engine, measure

    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    rows = dict(OURS)
    if limit:
        rows["ours searched {2,2}, 0.6 x DDP's memory"] = ("batch=2,model=2", None)
    out: dict = {}
    for label, (mesh, schedule) in rows.items():
        model, inputs, loss_fn = _build(name, dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        t = time.perf_counter()
        try:
            model, opt = partir_torch.auto_shard(model, inputs, mesh, loss_fn=loss_fn, optimizer=opt, schedule=schedule,
                                                 budget=60, progress=False, cache=False,
                                                 memory=limit if "memory" in label else None)
        except partir_torch.PartirError as e:
            out[label] = {"error": str(e)[:300]}
            continue
        apply_s = time.perf_counter() - t
        rec = engine.sharded(model)
        cmp = measure.compare(rec, measure.run_once(rec, model, opt, inputs))
        med, first, loss = _timed(lambda model=model, opt=opt, inputs=inputs: partir_torch.step(model, opt, *inputs),
                                  steps)
        peak = torch.tensor(cmp["measured_peak"])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        out[label] = {"step_s": med, "first_s": first, "loss": loss, "peak": int(peak), "apply_s": apply_s,
                      "predicted_step_s": model.partir_plan.cost["step_time_s"],
                      "predicted_peak": cmp["predicted_peak"], "plan": model.partir_plan.decisions,
                      "bytes_exact": all(r["predicted"] == r["measured"] for r in cmp["by_axis"]),
                      "calls": {f"{r['kind']}/{r['axes'][0]}": r["measured_calls"] for r in cmp["by_axis"]}}
        partir_torch.unshard(model)
    return out


def one(rank: int, world: int, name: str, steps: int) -> dict:
    base = baselines(rank, world, name, steps)
    row = {"model": name, "ranks": world, "baselines": base}
    row["ours"] = ours(rank, world, name, steps, 0.6 * base["DDP"]["peak"])
    return row


def summary(row: dict) -> list[dict]:
    """Per system: median ms, ratio to the best baseline that fits (the DDP-exceeding limit for the limited row)."""
    base = row["baselines"]
    best = min(v["step_s"] for v in base.values())
    out = [{"system": k, "step_ms": v["step_s"] * 1e3, "ratio": v["step_s"] / best, "peak_mib": v["peak"] / 2**20}
           for k, v in base.items()]
    for k, v in row["ours"].items():
        if "error" in v:
            out.append({"system": k, "error": v["error"]})
            continue
        same = SAME.get(k)
        out.append({"system": k, "step_ms": v["step_s"] * 1e3, "ratio": v["step_s"] / best,
                    "vs_same": v["step_s"] / base[same]["step_s"] if same in base else None,
                    "predicted_ms": v["predicted_step_s"] * 1e3, "peak_mib": v["peak"] / 2**20,
                    "bytes_exact": v["bytes_exact"]})
    return out


def write_doc(data: dict, doc: Path, picture: Path) -> None:
    """The table of every row and a bar chart of the ratios (docs/performance.md, docs/img/performance.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [f"Measured at commit `{data['commit']}` on torch {data['torch']}, {data['ranks']} gloo CPU ranks on "
             f"{data['cpus']} cores (`benchmarks/engine_torch.py`; `benchmarks/results/engine_torch.json`). Median "
             "step after two, AdamW, the same global batch; `x best` is the step over the best baseline's (DDP, "
             "FSDP2, TP x DP, FSDP2 x TP: what runs at all), `x same` over the baseline running the same plan.", "",
             "| model | system | step | x best | x same | predicted | peak / rank | bytes |",
             "|---|---|---|---|---|---|---|---|"]
    fig, axes = plt.subplots(1, len(data["rows"]), figsize=(4.2 * len(data["rows"]), 4.2), squeeze=False)
    for ax, row in zip(axes[0], data["rows"]):
        names, ratios = [], []
        for s in summary(row):
            if "error" in s:
                lines.append(f"| {row['model']} | {s['system']} | {s['error'][:90]} | | | | | |")
                continue
            pred = f"{s['predicted_ms']:.1f} ms" if "predicted_ms" in s else ""
            same = f"{s['vs_same']:.2f}" if s.get("vs_same") else ""
            exact = ("exact" if s["bytes_exact"] else "DIFFER") if "bytes_exact" in s else ""
            lines.append(f"| {row['model']} | {s['system']} | {s['step_ms']:.1f} ms | {s['ratio']:.2f} | {same} | "
                         f"{pred} | {s['peak_mib']:.2f} MiB | {exact} |")
            names.append(s["system"].replace("ours ", "").replace(", 0.6 x DDP's memory", " 0.6 mem"))
            ratios.append(s["ratio"])
        ax.barh(names, ratios, color=["0.6" if not n.startswith(("DP", "FSDP", "Meg", "sear")) or "2" in n[:5]
                                      else "tab:blue" for n in names])
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_title(row["model"])
        ax.set_xlabel("step / best baseline's")
        ax.invert_yaxis()
    fig.tight_layout()
    picture.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(picture, dpi=90)
    text = doc.read_text()
    begin, end = "<!-- BEGIN engine_torch -->\n", "<!-- END engine_torch -->"
    i, j = text.index(begin) + len(begin), text.index(end)
    doc.write_text(text[:i] + "\n".join(lines) + "\n" + text[j:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--models", nargs="+", default=["tiny-gpt2", "gpt2-small", "tiny-llama", "llama-small"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "engine_torch.json"))
    ap.add_argument("--table", action="store_true", help="write docs/performance.md from --out and stop")
    args = ap.parse_args()
    if args.table:
        write_doc(json.loads(Path(args.out).read_text()), ROOT / "docs" / "performance.md",
                  ROOT / "docs" / "img" / "performance.png")
        return
    from benchmarks.workloads.provenance import stamp
    from partir_torch.launch import Workers

    rows = []
    with Workers(args.ranks, timeout=3600) as w:
        for name in args.models:
            rows.append(w.run(one, name, args.steps)[0])
            for s in summary(rows[-1]):
                print(f"{name:<12} {s['system']:<40} " + (s["error"][:80] if "error" in s else
                      f"{s['step_ms']:8.1f} ms  x{s['ratio']:.2f}" + (f"  same-plan x{s['vs_same']:.2f}"
                      if s.get("vs_same") else "") + (f"  predicted {s['predicted_ms']:.1f} ms"
                                                     if "predicted_ms" in s else "")), flush=True)
    Path(args.out).write_text(json.dumps({**stamp(), "machine": platform.platform(), "cpus": __import__("os")
                                          .cpu_count(), "ranks": args.ranks, "rows": rows}, indent=1))
    print(f"wrote {args.out}; {math.nan if not rows else len(rows)} models")


if __name__ == "__main__":
    main()
