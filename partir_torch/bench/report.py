"""docs/benchmarks.md: the scenarios (cost model), their anytime curve, and the zoo on the engines (measured).

Each part's rows come from its module (`scenarios.run`, `engines.run_one`); this one only writes them: tables
that name the command reproducing each row, and matplotlib charts beside them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from partir_torch.bench.engines import BYTES_BAR, HARDWARE, MEMORY, MESHES, MODELS, verdicts
from partir_torch.bench.scenarios import SIMPLICITY


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def chart(name: str, row: dict[str, Any], path: Path) -> Path:
    """The found plan's predicted step time beside each expert's: compute and communication per axis stacked,
    peak memory above each bar, an expert that does not fit hatched."""
    plt = _plt()
    bars = {"found": row["found"], **{k: v for k, v in row["experts"].items() if "error" not in v}}
    axes = sorted({a for v in bars.values() for a in v["comm_time_by_axis"]})
    fig, ax = plt.subplots(figsize=(1.0 + 0.75 * len(bars), 3.6), dpi=100)
    cmap = plt.get_cmap("Set2")
    for i, (k, v) in enumerate(bars.items()):
        bottom, hatch = 0.0, None if v["feasible"] else "//"
        for j, (part, s) in enumerate([("compute", v["compute_time_s"]),
                                       *((f"comm {a}", v["comm_time_by_axis"].get(a, 0.0)) for a in axes)]):
            ax.bar(i, s * 1e3, bottom=bottom, color=cmap(j), hatch=hatch, edgecolor="black" if k == "found" else
                   "0.4", label=part if i == 0 else None)
            bottom += s * 1e3
        ax.text(i, bottom, f"{v['peak_memory_bytes'] / 2**30:.1f}G", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(bars)), list(bars), rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("predicted step (ms)", fontsize=8)
    ratio = f"{row['ratio']:.3f} x the best expert ({row['best_expert']})" if "ratio" in row else "no expert fits"
    ax.set_title(f"{name}: {row['model']} on {row['mesh']}, {row['hardware']}: found = {ratio}", fontsize=8)
    ax.legend(fontsize=6)
    return _save(plt, fig, path)


def anytime_chart(rows: dict[str, dict[str, Any]], path: Path) -> Path:
    """The found plan's ratio to the best expert against the search's episode budget, a line per scenario."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    for name, row in rows.items():
        pts = row.get("anytime") or []
        if pts:
            ax.plot([p["episodes"] for p in pts], [p["ratio"] for p in pts], marker="o", label=name)
    ax.axhline(1.0, color="0.3", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("search budget (episodes)", fontsize=8)
    ax.set_ylabel("found / best expert (predicted step)", fontsize=8)
    ax.set_title("anytime: the found plan against the best expert that fits", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    return _save(plt, fig, path)


def engine_chart(rows: list[dict[str, Any]], mesh: str, path: Path) -> Path:
    """Per model on `mesh`: the measured step (per hardware) of the found plan, of the best expert that fits,
    and of torch_xla's auto-sharding, on the torch backend's measurement (XLA's auto-sharding on its own)."""
    plt = _plt()
    mine = [r for r in rows if r["mesh"] == mesh]
    fig, axs = plt.subplots(1, len(HARDWARE), figsize=(2.0 + 1.1 * len(mine) * len(HARDWARE), 3.4), dpi=100)
    for ax, hw in zip(axs, HARDWARE):
        for i, r in enumerate(mine):
            v = _verdict(r, r["engines"][0], hw)
            auto = r.get("xla_auto", {}).get("step_s", {}).get(hw)
            bars = [("found", v.get("found_s"), "tab:green"), ("best expert", v.get("best_s"), "tab:blue"),
                    ("torch_xla auto", auto, "tab:gray")]
            for j, (label, s, color) in enumerate(bars):
                if s is not None:
                    ax.bar(i + (j - 1) * 0.27, s * 1e3, width=0.26, color=color, label=label if i == 0 else None)
        ax.set_xticks(range(len(mine)), [r["model"] for r in mine], rotation=45, ha="right", fontsize=7)
        ax.set_ylabel(f"step on {hw} from measured bytes (ms)", fontsize=7)
        ax.set_title(f"{mesh}, {hw}", fontsize=8)
        ax.legend(fontsize=6)
    return _save(plt, fig, path)


def _verdict(row: dict[str, Any], engine: str, hw: str) -> dict[str, Any]:
    """(recomputed from the row's measurements: a JSON of an earlier run reads as this code judges it)"""
    return next((v for v in verdicts(row) if v["engine"] == engine and v["hardware"] == hw), {})


def _cell(v: dict[str, Any]) -> str:
    if "ratio" not in v:
        return v.get("why", "no expert fits")[:60] if v.get("why") else "no expert fits"
    mark = (" *" if v.get("why") else "") + (" †" if v.get("memory") else "")
    return f"{v['ratio']:.3f} ({v['best']}){mark}"


def _commits(rows: list[dict[str, Any]], commit: str | None) -> str:
    """Which code measured the rows (its search found their plans)."""
    later: dict[str, list[str]] = {}
    for r in rows:
        if r.get("commit") and r["commit"] != commit:
            later.setdefault(r["commit"], []).append(f"{r['model']} on {{{r['mesh']}}}")
    text = f" Measured with the code of commit `{commit}` (the found plans are its search's)" if commit else ""
    text += "".join(f"; measured again at `{c}`: {', '.join(names)}" for c, names in later.items())
    return text + "." if text else ""


def engine_lines(rows: list[dict[str, Any]], episodes: int, out: Path, commit: str | None = None) -> list[str]:
    """The engine part of docs/benchmarks.md (and one chart per mesh under `out`); `commit`: the code the rows
    were measured with (its search found their plans), unless a row names its own (measured again later)."""
    engines = sorted({e for r in rows for e in r["engines"]}, key=["torch", "torch_xla"].index)
    heads = [f"{e} {hw}" for e in engines for hw in HARDWARE]
    lines = ["", "## The zoo on the engines", "",
             "Written by `.venv/bin/python benchmarks/engine.py` (`partir_torch/bench/engines.py` says how): every "
             "zoo model at tiny size (global batch 16) on three 8-device meshes, every expert and the plan the "
             f"search finds ({episodes} episodes) for each hardware, all under a memory limit of {MEMORY:g} x the "
             "replicated step's peak (without it, replicating wins at these sizes on any hardware), each distinct "
             "plan run for one step through the torch backend (gloo ranks) and torch_xla SPMD (XLA CPU). A "
             "cell is the found plan's step over the best fitting expert's, both *from the bytes the engine "
             "moved* (the cost model's compute plus each collective run, priced at the hardware's bandwidth and "
             "latency on its axes); the expert named is the best. An expert fits when its predicted and its "
             "measured peak are both within the limit. `*`: slower, `†`: the found plan over the limit as "
             "measured, with the reasons below."
             + _commits(rows, commit),
             "",
             f"| model | mesh | distinct plans | found ({HARDWARE[0]}) | {' | '.join(heads)} "
             "| torch_xla auto-sharding |",
             "|---|---|---|---|" + "---|" * len(heads) + "---|"]
    slower, over = [], []
    for r in rows:
        found = next(p for p in r["plans"] if f"found {HARDWARE[0]}" in p["names"])
        acts = "; ".join(found["actions"]) or "(replicated)"
        if len(acts) > 90:
            acts = acts[:87] + "..."
        cells = []
        for e in engines:
            for hw in HARDWARE:
                v = _verdict(r, e, hw)
                cells.append(_cell(v))
                if v.get("why"):
                    slower.append(f"- {r['model']} on {r['mesh']}, {e}, {hw}: {v['why']}")
                if v.get("memory"):
                    over.append(f"- {r['model']} on {r['mesh']}, {e}, {hw}: {v['memory']}")
        auto = r.get("xla_auto", {})
        if "error" in auto:
            auto_cell = f"failed: {auto['error'][:60]}"
        elif auto:
            fits = auto["peak"] is not None and auto["peak"] <= r["limits"][HARDWARE[0]]
            n = sum(c[2] for c in auto["collectives"])
            auto_cell = (f"{n} collectives, peak {auto['peak'] / 1024:.0f} KiB (replicated: "
                         f"{auto['replicated_peak'][HARDWARE[0]] / 1024:.0f} KiB); "
                         f"{'fits' if fits else 'does not fit'}")
        else:
            auto_cell = "—"
        lines.append(f"| {r['model']} | {r['mesh']} | {len(r['plans'])} | `{acts}` | {' | '.join(cells)} | "
                     f"{auto_cell} |")
    if slower:
        lines += ["", "`*` Where the found plan measures slower than the best expert that fits:", "", *slower]
    if over:
        lines += ["", "`†` Where the found plan's measured peak is over the limit (the engine's memory against the "
                  "cost model's, docs/engines.md):", "", *over]
    lines += ["", "### Measured bytes against predicted", "",
              "Every distinct plan's collective bytes as the engine ran them over the plan's prediction (torch_xla: "
              "the prediction in XLA's form, one collective over several axes where the plan sums over them, "
              "`backends/verify.py`).", "",
              "| engine | bar | plans run | within the bar | outside: model, mesh, plan, measured / predicted |",
              "|---|---|---|---|---|"]
    for e in engines:
        ran, outside = 0, []
        for r in rows:
            for p in r["plans"]:
                ratio = p["measured"].get(e, {}).get("bytes_ratio")
                if ratio is None:
                    continue
                ran += 1
                if abs(ratio - 1) > BYTES_BAR[e]:
                    outside.append(f"{r['model']} {r['mesh']} {p['names'][0]} {ratio:.2f}")
        lines.append(f"| {e} | ±{BYTES_BAR[e]:.0%} | {ran} | {ran - len(outside)} | {'; '.join(outside) or '—'} |")
    if "torch_xla" in engines:
        lines += ["", _xla_causes(rows)]
    errors = [f"- {r['model']} on {r['mesh']}, {p['names'][0]}, {e}: {m['error']}" for r in rows for p in r["plans"]
              for e, m in p["measured"].items() if "error" in m]
    errors += [f"- {r['model']} on {r['mesh']}: {k} cannot apply ({why})" for r in rows
               for k, why in r.get("failed", {}).items()]
    if errors:
        lines += ["", "Plans that did not run or apply:", "", *errors]
    done = {(r["model"], r["mesh"]) for r in rows}
    missing = [f"{m} on {mesh}" for mesh in MESHES for m in MODELS if (m, mesh) not in done]
    if missing and any(r["mesh"] in MESHES for r in rows):
        lines += ["", f"Not in this run ({len(missing)} of {len(MODELS) * len(MESHES)}; `benchmarks/engine.py "
                  "--models ... --meshes ...` runs them): " + ", ".join(missing) + "."]
    for mesh in dict.fromkeys(r["mesh"] for r in rows):
        png = engine_chart(rows, mesh, out / f"bench-engines-{mesh.replace('=', '').replace(',', '-')}.png")
        lines += ["", f"![{mesh}]({png.name})"]
    return lines


def _xla_causes(rows: list[dict[str, Any]]) -> str:
    """What XLA ran differently in the torch_xla plans outside the bar, counted from the collectives each ran."""
    outside = [(p["predicted_bytes"], p["measured"]["torch_xla"]) for r in rows for p in r["plans"]
               if abs(p["measured"].get("torch_xla", {}).get("bytes_ratio", 1) - 1) > BYTES_BAR["torch_xla"]]
    causes = {"run their reduce-scatters as all-reduces (XLA's CPU pipeline forms no reduce-scatter: "
              "docs/cost-model.md item 1)": 0, "add collective-permutes the plan has not (GSPMD's re-layouts)": 0,
              "move other all-to-all bytes than the plan (GSPMD's own dispatch or chunked reads)": 0}
    for predicted, measured in outside:
        ran: dict[str, int] = {}
        for kind, _axes, _count, nbytes in measured["collectives"]:
            ran[kind] = ran.get(kind, 0) + nbytes
        planned = {k: sum(v.values()) for k, v in predicted.items()}
        for cause, hit in zip(causes, (planned.get("reduce-scatter", 0) > ran.get("reduce-scatter", 0),
                                       ran.get("collective-permute", 0) > planned.get("collective-permute", 0),
                                       ran.get("all-to-all", 0) != planned.get("all-to-all", 0))):
            causes[cause] += hit
    said = "; ".join(f"{n} {c}" for c, n in causes.items())
    return (f"Of the {len(outside)} torch_xla plans outside the bar (a plan can have several causes): {said}. "
            "XLA cannot be held to the plan's own per-rank program, as the torch backend runs it: torch_xla 2.9's "
            "manual-sharding regions run all-reduce, all-gather and reduce-scatter, but not all-to-all "
            "(`tests/backends/test_xla_known_bugs.py`), so the backend constrains GSPMD's partitioning instead.")


def write(rows: dict[str, dict[str, Any]], out: Path, episodes: int,
          engine_rows: list[dict[str, Any]] | None = None, engine_episodes: int | None = None,
          engine_commit: str | None = None) -> Path:
    """`out/benchmarks.md` and its charts."""
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Benchmarks: the search against the experts", "",
             "Written by `partir-torch bench` (`partir_torch/bench/` says how). The scenarios are predicted by the "
             f"cost model, the search on {episodes} episodes (deterministic; the CLI's default budget). Hatched "
             "bars: the plan does not fit in memory. The search keeps an action only when it buys more than "
             f"{SIMPLICITY:.1%} of the step time (a decision must earn its place: `search/local.py`), so a ratio up "
             "to that margin above 1 is a simpler plan, not a worse search. The zoo on the engines (below) is "
             "measured.", "",
             "| scenario | model, mesh, hardware | found (ms) | best expert that fits (ms) | ratio | search (s) "
             "| command |", "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        f = row["found"]
        best = (f"{row['best_expert']} {row['experts'][row['best_expert']]['step_time_s'] * 1e3:.2f}"
                if "best_expert" in row else "none fits")
        ratio = f"{row['ratio']:.3f}" if "ratio" in row else "—"
        if "ratio" in row and 1.0 < row["ratio"] <= 1.0 + SIMPLICITY:
            ratio += " (within the simplicity margin)"
        lines.append(f"| {name} | {row['model']}, {row['mesh']}, {row['hardware']} | {f['step_time_s'] * 1e3:.2f}"
                     f"{'' if f['feasible'] else ' (does not fit)'} | {best} | {ratio} | {f['search_s']:.1f} | "
                     f"`partir-torch bench --only {name} --episodes {episodes}` |")
    if any(row.get("anytime") for row in rows.values()):
        png = anytime_chart(rows, out / "bench-anytime.png")
        budgets = sorted({p["episodes"] for row in rows.values() for p in row.get("anytime", [])})
        lines += ["", "## Anytime", "", f"![anytime]({png.name})", "",
                  "| scenario | " + " | ".join(f"{b} episodes" for b in budgets) + " |",
                  "|---|" + "---|" * len(budgets)]
        for name, row in rows.items():
            got = {p["episodes"]: p for p in row.get("anytime", [])}
            lines.append(f"| {name} | " + " | ".join(
                f"{got[b]['ratio']:.3f} ({got[b]['search_s']:.1f} s){'' if got[b]['feasible'] else ' no fit'}"
                if b in got else "—" for b in budgets) + " |")
    if engine_rows:
        lines += engine_lines(engine_rows, engine_episodes or episodes, out, engine_commit)
    for name, row in rows.items():
        png = chart(name, row, out / f"bench-{name}.png")
        lines += ["", f"## {name}", "", f"![{name}]({png.name})", "",
                  f"Found: `{'; '.join(row['found']['actions'])}`.", "",
                  "| expert | schedule | step (ms) | peak memory (GiB) | fits |", "|---|---|---|---|---|"]
        for k, v in row["experts"].items():
            if "error" in v:
                lines.append(f"| {k} | `{v['schedule']}` | — | — | {v['error'][:80]} |")
            else:
                lines.append(f"| {k} | `{v['schedule']}` | {v['step_time_s'] * 1e3:.2f} | "
                             f"{v['peak_memory_bytes'] / 2**30:.2f} | {'yes' if v['feasible'] else 'no'} |")
    path = out / "benchmarks.md"
    path.write_text("\n".join(lines) + "\n")
    return path
