"""Capture benchmark: whole-training-step capture time and peak memory for zoo models on fake tensors.

    .venv/bin/python benchmarks/capture.py [--repeat 3] [--models gpt2-small llama-7b ...]

Each model runs in a fresh subprocess (so peak RSS is that model's alone, and the first-call warm-up of
torch's tracing machinery is counted once as `first_s`); prints a table and writes
benchmarks/results/capture.json. Targets (issue [capture]): GPT-2 small (batch 8, seq 1024) + AdamW <= 5 s;
Llama-7B shape on meta <= 20 s and <= 4 GiB peak RSS.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT = ["gpt2-small", "gpt2-xl", "llama-7b", "llama-70b", "unet", "gns", "moe", "vit-base"]
TARGETS = {"gpt2-small": (5.0, None), "llama-7b": (20.0, 4.0)}


def one(name: str, repeat: int) -> dict:
    t0 = time.perf_counter()
    import torch  # noqa: F401  (import time is not capture time)

    from partir_torch import models
    from partir_torch.capture import capture

    import_s = time.perf_counter() - t0
    times, program = [], None
    for _ in range(repeat):
        model, inputs, loss_fn = models.build(name, device="meta")
        t = time.perf_counter()
        program = capture(model, inputs, loss_fn, "adamw")
        times.append(time.perf_counter() - t)
    s = program.summary()
    return {
        "model": name,
        "first_s": times[0],
        "median_s": statistics.median(times[1:] or times),
        "times_s": times,
        "import_s": import_s,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "ops": s["ops"],
        "ops_by_phase": s["ops_by_phase"],
        "params": s["params"],
        "groups": len(s["groups"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=DEFAULT)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "capture.json"))
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.repeat)))
        return
    rows = []
    for name in args.models:
        res = subprocess.run(
            [sys.executable, __file__, "--one", name, "--repeat", str(args.repeat)],
            capture_output=True, text=True, check=True,
        )
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"capture (AdamW training step, fake tensors; median of {args.repeat}, first run separately)")
    for c in ("model", "params", "ops", "groups", "first s", "median s", "peak RSS GiB", "target"):
        t.add_column(c, justify="left" if c == "model" else "right")
    for r in rows:
        tgt = TARGETS.get(r["model"])
        verdict = ""
        if tgt:
            ok = r["median_s"] <= tgt[0] and (tgt[1] is None or r["peak_rss_gib"] <= tgt[1])
            verdict = ("ok " if ok else "MISS ") + f"<= {tgt[0]} s" + (f", <= {tgt[1]} GiB" if tgt[1] else "")
        t.add_row(r["model"], f"{r['params'] / 1e9:.2f}B", str(r["ops"]), str(r["groups"]), f"{r['first_s']:.2f}",
                  f"{r['median_s']:.2f}", f"{r['peak_rss_gib']:.2f}", verdict)
    Console(width=140).print(t)
    machine = {"python": platform.python_version(), "cpus": __import__("os").cpu_count(), "node": platform.machine()}
    path = Path(args.out)
    if path.exists():  # a run of some models replaces their rows, in place, and keeps the others'
        new = {r["model"]: r for r in rows}
        old = json.loads(path.read_text()).get("results", [])
        rows = [new.pop(r["model"], r) for r in old] + list(new.values())
    out = {"machine": machine, "repeat": args.repeat, "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
