"""Model sweep benchmark: every third-party architecture of `benchmarks/workloads/thirdparty.py` through
capture, coverage, plan (Auto, small episode budget, fallback only when needed) and the simulator.

    .venv/bin/python benchmarks/models.py [--names hf-gpt2 tv-resnet18 ...] [--budget 30] [--no-write-known]

Each architecture runs in a fresh subprocess (a library's import or a crash stays there). Writes
benchmarks/results/models.json and docs/models.md (the table), and regenerates the known-failures dict of
tests/models/test_sweep.py from the architectures that do not reach "ok" (run over all of them).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST = ROOT / "tests" / "models" / "test_sweep.py"
sys.path.insert(0, str(ROOT))  # this checkout's partir_torch, also in the workers


def one(name: str, budget: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    from benchmarks.workloads import sweep

    return sweep.run(name, budget=budget).to_json()


def _reason(r: dict) -> str:
    err = (r.get("error") or "").replace("\n", " ")
    err = re.sub(r"/\S*/site-packages/", "", err)
    return err[:300]


def write_known(results: list[dict]) -> None:
    known = {r["name"]: (r["stage"], _reason(r)) for r in results if r["stage"] != "ok"}
    def lines(why: str) -> str:  # the reason in pieces, so that no line of the test file exceeds 120 characters
        return "\n".join(f"        {why[i:i + 80]!r}" for i in range(0, len(why), 80)) or "        ''"

    body = "".join(f"    {n!r}: ({s!r},\n{lines(why)}),\n" for n, (s, why) in known.items())
    block = f"KNOWN_FAILURES: dict[str, tuple[str, str]] = {{\n{body}}}\n"
    text = TEST.read_text()
    new = re.sub(r"(# BEGIN KNOWN_FAILURES[^\n]*\n).*?(# END KNOWN_FAILURES)",
                 lambda m: m.group(1) + block + m.group(2),
                 text, flags=re.S)
    TEST.write_text(new)


def table(results: list[dict], budget: int) -> str:
    n = len(results)
    cap = sum(r["stage"] not in ("build", "capture") for r in results)
    cap_nf = sum(r["stage"] not in ("build", "capture") and "captured with fallback=True" not in r["notes"]
                 for r in results)
    plan_nf = sum(r["planned_without_fallback"] for r in results)
    plan_f = sum(r["planned_with_fallback"] for r in results)
    ok = sum(r["stage"] == "ok" for r in results)
    sim_f = sum(r["stage"] in ("ok", "plan") and r["max_rel_diff"] is not None for r in results)
    lines = [
        "# Model sweep",
        "",
        "Every architecture of `benchmarks/workloads/thirdparty.py` (tiny configs, no downloaded weights), its",
        "training step with AdamW captured, `coverage` run, planned on `{batch: 2, model: 2}` with the schedule",
        "`batch:BatchParallel;model:Auto` (" + f"{budget}" + " episodes; the search gets 60 % of the batch-parallel",
        "plan's peak memory, so it must shard the model axis), then simulated per device against the unsharded step",
        "(≤ 1e-5 relative in fp32; where fp32 rounding alone exceeds that — BatchNorm over a few elements is",
        "ill-conditioned — the same plan is simulated on the fp64 step and must be within 1e-9, see the notes).",
        "Regenerate with `.venv/bin/python benchmarks/models.py` (`--update NAME…` reruns some and merges); the",
        "known failures of `tests/models/test_sweep.py` are rewritten from the same results. A submodule whose forward",
        "has data-dependent shapes (Mixtral's MoE routing) is captured with `fallback=True` as one opaque op that runs",
        "replicated, its FLOPs measured on a real run (`partir_torch/capture/opaque.py`): such a row plans and",
        "simulates only with fallback.",
        "",
        f"**{n} architectures: {cap} capture ({cap_nf} without fallback), {plan_nf} plan without fallback, "
        f"{plan_f} with fallback, "
        f"{ok} pass the simulator without fallback ({sim_f} with fallback).**",
        "",
        "| architecture | params | ops | stage | plan w/o fallback | sharded params | max rel. diff | "
        "capture / plan / sim s | notes |",
        "|---|---:|---:|---|---|---:|---:|---|---|",
    ]
    for r in results:
        t = r["times"]
        times = " / ".join(f"{t[k]:.1f}" if k in t else "–" for k in ("capture_s", "plan_s", "simulate_s"))
        diff = f"{r['max_rel_diff']:.1e}" if r["max_rel_diff"] is not None else "–"
        notes = "; ".join(r["notes"] + ([_reason(r)] if r["stage"] != "ok" else [])).replace("|", "\\|")
        lines.append(f"| {r['name']} | {r['params']:,} | {r['ops']} | {r['stage']} | "
                     f"{'yes' if r['planned_without_fallback'] else 'no'} | {r['sharded_params'] or '–'} | {diff} | "
                     f"{times} | {notes} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--names", nargs="*")
    ap.add_argument("--budget", type=int, default=30)
    ap.add_argument("--no-write-known", action="store_true")
    ap.add_argument("--update", nargs="+", help="rerun these and merge them into benchmarks/results/models.json")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.budget)))
        return
    from benchmarks.workloads.thirdparty import NAMES

    names = args.update or args.names or NAMES
    results = []
    t0 = time.perf_counter()
    for name in names:
        out = subprocess.run([sys.executable, __file__, "--one", name, "--budget", str(args.budget)],
                             capture_output=True, text=True, cwd=ROOT)
        try:
            r = json.loads(out.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            r = {"name": name, "stage": "build", "error": f"worker crashed: {out.stderr[-300:]}", "params": 0, "ops": 0,
                 "planned_without_fallback": False, "planned_with_fallback": False, "sharded_params": "",
                 "max_rel_diff": None, "times": {}, "notes": [], "coverage_missing": [], "agrees": True}
        results.append(r)
        print(f"{name:26s} {r['stage']:9s} {(r.get('error') or '')[:90]}", flush=True)
    total = time.perf_counter() - t0
    if args.update:  # merge into the last full run
        with open(ROOT / "benchmarks" / "results" / "models.json") as f:
            prev = json.load(f)
        fresh = {r["name"]: r for r in results}
        merged = {r["name"]: fresh.get(r["name"], r) for r in prev["results"]}
        merged.update(fresh)  # (architectures new to the sweep too, in its order)
        results = [merged[n] for n in NAMES if n in merged] + [r for n, r in merged.items() if n not in NAMES]
        total = prev["meta"]["total_s"]
    if args.update or not args.names:  # a full run: the results, the table and the known failures
        (ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
        meta = {"budget": args.budget, "python": platform.python_version(), "total_s": total}
        with open(ROOT / "benchmarks" / "results" / "models.json", "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
        (ROOT / "docs" / "models.md").write_text(table(results, args.budget))
        if not args.no_write_known:
            write_known(results)
    print(f"{len(results)} architectures in {total:.0f} s")


if __name__ == "__main__":
    main()
