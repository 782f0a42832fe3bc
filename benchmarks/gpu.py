"""The GPU check: the torch backend on CUDA, and the h100-sxm preset's compute model against measured kernels.

    .venv/bin/python benchmarks/gpu.py [--out benchmarks/results/gpu.json] [--quick]

Skips (exit 0, one line) without CUDA. On a GPU machine, in under 8 minutes on one H100:
1. calibration: a GPT (bf16, d=1024, 8 layers, batch 8 x 1024) step captured and run unsharded on the GPU
   under the profiler; per op class (matmul, attention, normalization, elementwise and the rest) the cost
   model's compute time on the preset of the device found (`cost.model.op_times`) beside the measured
   kernel time (the profiler's self device time per aten op), and the whole step's;
2. the step: with one GPU, the plan's rank program (eager, compiled) beside the plain eager step of the same
   model; with N >= 2 GPUs, on N NCCL ranks, the searched plan beside DDP and FSDP2 (`fully_shard`)
   (`benchmarks/engine_torch.py`'s comparison) on mesh batch=N/2,model=2.
Prints the tables and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

GPT = {"layers": "8", "width": "1024", "heads": "16", "vocab": "32768", "seq": "1024", "batch": "8",
       "dtype": "bfloat16"}
QUICK = {**GPT, "layers": "2", "seq": "512"}
CLASSES = {"matmul": ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear"), "attention": ("attention",),
           "normalization": ("norm",), "embedding": ("embedding",)}


def op_class(target: str) -> str:
    name = target.removeprefix("aten.").removeprefix("aten::").split(".")[0]
    for cls, keys in CLASSES.items():
        if any(name == k or (k in name and cls != "matmul") for k in keys):
            return cls
    return "elementwise and other"


def calibrate(config: dict, device: torch.device) -> dict:
    """Predicted compute per op class (the device's preset) against the profiler's kernel time."""
    from torch.profiler import ProfilerActivity, profile

    from partir_torch import models
    from partir_torch.backends.distributed.shard import hardware_of
    from partir_torch.capture import capture
    from partir_torch.cost.hardware import hardware
    from partir_torch.cost.model import op_times
    from partir_torch.ir import Mesh
    from partir_torch.propagate import ShardingState

    preset, _ = hardware_of(device)
    torch.manual_seed(0)
    model, inputs, loss_fn = models.build("gpt2-small", config, device=device)
    program = capture(model, inputs, loss_fn, "adamw", fold=False)
    state = ShardingState(program, Mesh.parse("batch=1"))
    times = op_times(state, hardware(preset))
    predicted: dict[str, float] = {}
    for op, t in zip(program.ops, times.tolist()):
        predicted[op_class(op.target)] = predicted.get(op_class(op.target), 0.0) + t
    params = {n: p.detach() for n, p in model.named_parameters()}
    states = {n: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p),
                  "step": torch.tensor(1.0, device=device)} for n, p in params.items()}
    buffers = dict(model.named_buffers())
    for _ in range(3):  # warm up (cuBLAS handles, autotuning)
        program.run(params, buffers, inputs, states)
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    program.run(params, buffers, inputs, states)
    torch.cuda.synchronize(device)
    wall = time.perf_counter() - t
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        program.run(params, buffers, inputs, states)
        torch.cuda.synchronize(device)
    measured: dict[str, float] = {}
    for e in prof.key_averages():
        if e.key.startswith("aten::") and e.self_device_time_total > 0:
            cls = op_class(e.key)
            measured[cls] = measured.get(cls, 0.0) + e.self_device_time_total / 1e6
    return {"preset": preset, "device": torch.cuda.get_device_name(device), "predicted_s": predicted,
            "measured_s": measured, "predicted_step_s": float(times.sum()), "measured_step_s": wall}


def single(config: dict) -> dict:
    """One GPU: the plan's rank program (eager and compiled) beside the plain eager step."""
    from partir_torch.launch import Workers

    with Workers(1, backend="nccl", timeout=900) as w:
        return w.run(_single, config)[0]


def _single(rank: int, world: int, config: dict) -> dict:
    import partir_torch
    from partir_torch import models

    out = {}
    dev = torch.device("cuda", 0)
    for mode in ("eager", "compiled", "plain"):
        torch.manual_seed(0)
        model, inputs, loss_fn = models.build("gpt2-small", config, device=dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if mode == "plain":
            def step(model=model, opt=opt, inputs=inputs, loss_fn=loss_fn):
                loss = loss_fn(model, *inputs)
                loss.backward()
                opt.step()
                opt.zero_grad()
                return loss
        else:
            model, opt = partir_torch.auto_shard(model, inputs, "batch=1", loss_fn=loss_fn, optimizer=opt,
                                                 backend="torch", compile=mode == "compiled")

            def step(model=model, opt=opt, inputs=inputs):
                return partir_torch.step(model, opt, *inputs)
        times = []
        for _ in range(6):
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            step()
            torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t)
        out[f"{mode}_first_s"], out[f"{mode}_step_s"] = times[0], statistics.median(times[2:])
        out[f"{mode}_peak_bytes"] = torch.cuda.max_memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu.json"))
    ap.add_argument("--quick", action="store_true", help="a 2-layer, 512-token GPT")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device found; skipped (run it on a GPU machine)")
        return
    config = QUICK if args.quick else GPT
    t0 = time.perf_counter()
    result: dict = {"gpus": torch.cuda.device_count(), "config": config,
                    "calibration": calibrate(config, torch.device("cuda", 0))}
    cal = result["calibration"]
    print(f"{cal['device']} (preset {cal['preset']}): step predicted {cal['predicted_step_s'] * 1e3:.1f} ms, "
          f"measured {cal['measured_step_s'] * 1e3:.1f} ms")
    for cls in sorted(set(cal["predicted_s"]) | set(cal["measured_s"])):
        p, m = cal["predicted_s"].get(cls, 0.0), cal["measured_s"].get(cls, 0.0)
        ratio = f"  ({m / p:.2f})" if p else ""
        print(f"  {cls:<22} predicted {p * 1e3:8.2f} ms  measured {m * 1e3:8.2f} ms{ratio}")
    n = torch.cuda.device_count()
    if n >= 2:
        sys.path.insert(0, str(Path(__file__).parent))
        from engine_torch import one

        from partir_torch.launch import Workers

        mesh = f"batch={n // 2},model=2"
        with Workers(n, backend="nccl", timeout=900) as w:
            result["engines"] = w.run(one, "gpt2-small", mesh, 6)[0]
        r = result["engines"]
        print(f"{n} GPUs, mesh {mesh}: plan {r['eager_step_s'] * 1e3:.1f} ms eager, {r['compiled_step_s'] * 1e3:.1f} "
              f"ms compiled; DDP {r['ddp_step_s'] * 1e3:.1f} ms; FSDP2 {r['fsdp2_step_s'] * 1e3:.1f} ms")
    else:
        result["single"] = r = single(config)
        print(f"1 GPU: the plan's rank program {r['eager_step_s'] * 1e3:.1f} ms eager, {r['compiled_step_s'] * 1e3:.1f}"
              f" ms compiled; the plain eager step {r['plain_step_s'] * 1e3:.1f} ms")
    result["wall_s"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
