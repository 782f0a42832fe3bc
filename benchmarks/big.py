"""A model that does not fit this machine replicated, trained on it sharded (issue [big]).

    .venv/bin/python benchmarks/big.py [--ranks 4] [--memory 5GiB] [--steps 2]

A GPT of GPT-2 large's shape (36 blocks, width 1280, vocab 50257: 774 M parameters; fp32 weights and AdamW's
two states are 9.3 GB a replica, so four replicas exceed this machine's 24 GiB) is built on the meta device,
planned by the search under a per-rank memory limit, initialized on each rank as its own parts only
(`backends/distributed/materialize.py`, `reset_parameters` module by module), and trained `--steps` steps on
`--ranks` gloo ranks. Per rank: the peak RSS (the process's high-water mark, `ru_maxrss`) after start-up,
after apply and after the steps, against the plan's predicted peak and the whole model's bytes (a rank that
held a whole copy would exceed them). Writes benchmarks/results/big.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SHAPE = {"layers": 36, "width": 1280, "heads": 20, "seq": 128, "batch": 8}


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def init(m: torch.nn.Module) -> None:
    """The zoo GPT's own initialization (its constructor's, which a meta build skips): GPT-2's embedding scale."""
    if isinstance(m, torch.nn.Embedding):
        torch.nn.init.normal_(m.weight, std=0.02 if m.num_embeddings > SHAPE["seq"] else 0.01)
    else:
        m.reset_parameters()


def rank(rank_: int, world: int, memory: str, steps: int) -> dict:
    import partir_torch
    from partir_torch import models
    from partir_torch.backends.distributed.engine import sharded

    out: dict = {"rank": rank_, "rss_start": _rss()}
    torch.manual_seed(0)
    model, inputs, loss_fn = models.build("gpt2-small", SHAPE, device="meta")
    inputs = tuple(torch.randint(0, 50257, x.shape) for x in inputs)  # (token ids and labels, real)
    out["params"] = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t = time.perf_counter()
    model, opt = partir_torch.auto_shard(model, inputs, f"batch={world}", loss_fn=loss_fn, optimizer=opt,
                                         memory=memory, init_fn=init, cache=False, progress=False)
    out["apply_s"] = time.perf_counter() - t
    out["rss_apply"] = _rss()
    plan = model.partir_plan
    out["predicted_peak"] = plan.cost["peak_memory_bytes"]
    out["init_bytes"] = sharded(model).init_bytes
    out["decisions"] = len(plan.decisions)
    out["local_param_bytes"] = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    out["losses"], out["step_s"] = [], []
    for _ in range(steps):
        t = time.perf_counter()
        out["losses"].append(float(partir_torch.step(model, opt, *inputs)))
        out["step_s"].append(time.perf_counter() - t)
    out["rss_steps"] = _rss()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--memory", default="5GiB")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    from partir_torch.launch import Workers

    with Workers(args.ranks, timeout=3600) as w:
        rows = w.run(rank, args.memory, args.steps)
    whole = rows[0]["params"] * 4
    result = {"shape": SHAPE, "ranks": args.ranks, "memory": args.memory, "params": rows[0]["params"],
              "whole_param_bytes": whole, "replica_bytes": whole * 3, "rows": rows}
    (ROOT / "benchmarks" / "results" / "big.json").write_text(json.dumps(result, indent=1))
    g = 2**30
    print(f"{rows[0]['params'] / 1e6:.0f} M parameters: {whole / g:.2f} GiB of weights, {3 * whole / g:.2f} GiB with "
          f"AdamW's states a replica; {args.ranks} ranks, limit {args.memory}")
    for r in rows:
        step = r["rss_steps"] - r["rss_start"]
        print(f"rank {r['rank']}: peak RSS {r['rss_steps'] / g:.2f} GiB ({r['rss_start'] / g:.2f} at start; after "
              f"apply {r['rss_apply'] / g:.2f}), above start {step / g:.2f} GiB = {step / r['predicted_peak']:.2f} x "
              f"the predicted {r['predicted_peak'] / g:.2f} GiB; local weights {r['local_param_bytes'] / g:.2f} GiB; "
              f"losses {[round(x, 4) for x in r['losses']]}; steps {[round(s, 1) for s in r['step_s']]} s, "
              f"apply {r['apply_s']:.0f} s")


if __name__ == "__main__":
    main()
