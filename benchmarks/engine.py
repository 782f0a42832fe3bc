"""The zoo through both engines, every expert beside the found plan, priced from the bytes each engine moved.

    .venv/bin/python benchmarks/engine.py [--models tiny-gpt2 ...] [--meshes batch=8 ...] [--episodes 200]
        [--engines torch torch_xla] [--out benchmarks/results/engine.json]

`partir_torch/bench/engines.py` says what runs and how a row is priced; the JSON is rewritten after every
model, and `partir-torch bench` reads it into docs/benchmarks.md (`--engines-from`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    from benchmarks.workloads import provenance
    from partir_torch.bench import engines

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(engines.MODELS))
    ap.add_argument("--meshes", nargs="+", default=list(engines.MESHES))
    ap.add_argument("--episodes", type=int, default=200)
    ap.add_argument("--engines", nargs="+", default=["torch", "torch_xla"])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "engine.json"))
    args = ap.parse_args()
    out, t0 = Path(args.out), time.perf_counter()
    commit = provenance.commit()

    def save(rows: list[dict]) -> None:
        for v in rows[-1]["verdicts"]:
            print(f"  {v['engine']} {v['hardware']}: found / best expert "
                  f"{v.get('ratio', float('nan')):.3f} ({v.get('best')}) {v.get('why', '')}", flush=True)
        out.write_text(json.dumps({"episodes": args.episodes, "commit": commit or None, "rows": rows}, indent=1,
                                  default=str))

    engines.run(args.models, args.meshes, args.episodes, tuple(args.engines), on_row=save)
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")

if __name__ == "__main__":
    main()
