"""The reproduction tables and figures from run metrics (docs/benchmarks.md "Reporting").

Reads ``results/<run>/runs/<family>/<arm>/seed<k>/metrics.jsonl`` (one JSON object per RL step;
an arm is a composition plus settings overrides, by default one arm per composition named after
it) and renders, in the seed's layout:
- ``logprob_diff.md/.csv``: rollout-vs-trainer |Δlogprob| per family, native vs IsoExec: mean of
  the per-step means, mean of the per-step stds, the largest per-step max, bitwise-equal fraction;
- ``step_time.md/.csv``: generation (seconds per step and per 1k generated tokens, since paired
  runs generate different lengths), pre-update scoring, policy training (the mini-batch updates,
  as verl counts it) and full-step seconds, native vs IsoExec, with the overhead in percent. Step 0
  (compilation, CUDA-graph capture) is shown on its own and kept out of the means; a step that
  trained nothing (every group dropped) is kept out of the training and full-step means and
  counted in the table;
- ``logprob_diff.png``: per-step mean |Δlogprob| on a log scale (an exact 0 cannot sit on a log
  axis: it is drawn at a floor line labelled "exactly 0");
- ``step_time.png``: step-time bars per family and stage.

The headline columns compare the arm named ``native`` with the arm named ``isoexec`` (or the first
arm of each composition). When the runs hold other arms (e.g. native + token TIS, native + TIS +
K3 rejection), both tables end with a per-arm section, one row group per family and arm.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from pathlib import Path
from typing import Iterable

from ..paths import atomic_write

ZERO_FLOOR = 1e-12


def read_metrics(path: str | Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except ValueError:
                raise ValueError(f"{path}:{i + 1}: not a JSON line") from None
    return rows


def run_from_folder(seed_dir: str | Path) -> dict:
    """One run folder ``.../runs/<family>/<composition>/seed<k>`` as {family, composition, seed, steps}."""
    seed_dir = Path(seed_dir)
    p = seed_dir / "metrics.jsonl"
    settings = {}
    cfg = seed_dir / "rl_config.json"
    if cfg.exists():  # the run's settings, where the runner recorded them
        try:
            settings = json.loads(cfg.read_text())
        except ValueError:
            settings = {}
    arm = seed_dir.parent.name
    return {"family": seed_dir.parent.parent.name, "arm": arm, "composition": settings.get("composition", arm),
            "seed": int(seed_dir.name[4:]), "path": str(p), "steps": read_metrics(p), "settings": settings}


def find_runs(runs_dir: str | Path) -> list[dict]:
    """Every run folder under runs_dir that has a metrics.jsonl."""
    return [run_from_folder(p.parent) for p in sorted(Path(runs_dir).glob("*/*/seed*/metrics.jsonl"))]


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else float("nan")


def _trained(x: dict) -> bool:
    """Whether a step ran mini-batch updates (older metrics lack "trained": use responses_trained)."""
    if "trained" in x:
        return bool(x["trained"])
    return x.get("responses_trained", 1) > 0


def _per_1k(x: dict):
    if x.get("time_generation_per_1k_tokens_s") is not None:
        return x["time_generation_per_1k_tokens_s"]
    tok = x.get("tokens_generated")
    return x["time_generation_s"] / tok * 1000 if tok else None


def summarize(run: dict) -> dict:
    """Per-run means. Timing means cover steps >= 1 (step 0 compiles and captures graphs; it is
    reported as ``t_step0``); training and full-step means cover only steps that trained."""
    s = run["steps"]
    warm = [x for x in s if x["step"] >= 1] or s
    trained = [x for x in warm if _trained(x)]
    step0 = next((x for x in s if x["step"] == 0), None)
    return {"family": run["family"], "arm": run.get("arm", run["composition"]), "composition": run["composition"],
            "seed": run["seed"], "steps": len(s),
            "dlp_mean": _mean([x["logprob_abs_diff_mean"] for x in s]),
            "dlp_std": _mean([x["logprob_abs_diff_std"] for x in s]),
            "dlp_max": max((x["logprob_abs_diff_max"] for x in s), default=float("nan")),
            "equal_frac": _mean([x["bitwise_equal_frac"] for x in s]),
            "reward": _mean([x["reward_mean"] for x in s]),
            "t_gen": _mean([x["time_generation_s"] for x in warm]),
            "t_gen_1k": _mean([_per_1k(x) for x in warm]),
            "t_score": _mean([x["time_scoring_s"] for x in warm]),
            "t_train": _mean([x["time_training_s"] for x in trained]),
            "t_step": _mean([x["time_step_s"] for x in trained]),
            "t_step0": step0["time_step_s"] if step0 else float("nan"),
            "timed_steps": len(warm), "trained_steps": len(trained),
            "untrained_steps": sum(not _trained(x) for x in warm),
            # steps >= 1 that compiled Triton kernels inside their timing (None: not recorded)
            "compile_steps": (sum(bool(x["kernels_compiled"]) for x in warm)
                              if all("kernels_compiled" in x for x in warm) else None)}


def _pool(rows: list[dict]) -> dict:
    """Seeds of one (family, composition) pooled: means of means, max of maxes."""
    out = dict(rows[0])
    for k in ("dlp_mean", "dlp_std", "equal_frac", "reward", "t_gen", "t_gen_1k", "t_score", "t_train", "t_step",
              "t_step0"):
        out[k] = _mean([r[k] for r in rows])
    out["dlp_max"] = max(r["dlp_max"] for r in rows)
    for k in ("steps", "timed_steps", "trained_steps", "untrained_steps"):
        out[k] = sum(r[k] for r in rows)
    known = [r["compile_steps"] for r in rows if r.get("compile_steps") is not None]
    out["compile_steps"] = sum(known) if len(known) == len(rows) else None
    out["seeds"] = len(rows)
    return out


def pooled(runs: Iterable[dict]) -> dict[tuple[str, str], dict]:
    """Per (family, arm): the seeds pooled."""
    groups: dict[tuple[str, str], list] = {}
    for r in runs:
        groups.setdefault((r["family"], r.get("arm", r["composition"])), []).append(summarize(r))
    return {k: _pool(v) for k, v in groups.items()}


def composition_side(composition: str) -> str | None:
    """Which headline column a composition's runs belong to: "native" for the stock compositions
    (``native`` and its parallel variants such as ``native_tp4``), "isoexec" for the invariant ones
    (``isoexec``, ``isoexec_tp4``, ``isoexec_ep4``), None for any other name. The project's
    composition files are named this way (configs/compositions/)."""
    for side in ("native", "isoexec"):
        if composition == side or composition.startswith(side + "_"):
            return side
    return None


def headline_arm(P: dict, family: str, side: str):
    """The arm a headline column (``side``: "native" or "isoexec") shows: the arm named after the
    side, else the first (by name) arm whose composition is the side's own, else the first whose
    composition is on that side (e.g. ``native_tp4`` for "native" when the pair runs under TP)."""
    if (family, side) in P:
        return P[(family, side)]
    for match in (lambda c: c == side, lambda c: composition_side(c) == side):
        arms = sorted(a for f, a in P if f == family and match(P[(f, a)]["composition"]))
        if arms:
            return P[(family, arms[0])]
    return None


def _arm_sections(P: dict) -> tuple[list[str], list[str]]:
    """Per-arm rows for both tables, when some arm is not simply a composition under its own name
    (the default arms are already the headline columns)."""
    if all(a == x["composition"] for (_, a), x in P.items()):
        return [], []
    lp = ["", "## Per arm", "", "| family | arm | composition | mean | std | max | equal | steps |",
          "|---|---|---|---|---|---|---|---|"]
    st = ["", "## Per arm", "", "| family | arm | composition | generation s | pre-update scoring s | "
          "policy training s | full step s | trained / timed steps |", "|---|---|---|---|---|---|---|---|"]
    for (f, a) in sorted(P):
        x = P[(f, a)]
        lp.append(f"| {f} | {a} | {x['composition']} | {_g(x['dlp_mean'])} | {_g(x['dlp_std'])} | "
                  f"{_g(x['dlp_max'])} | {_g(x['equal_frac'])} | {x['steps']} |")
        st.append(f"| {f} | {a} | {x['composition']} | {_g(x['t_gen'])} | {_g(x['t_score'])} | {_g(x['t_train'])} | "
                  f"{_g(x['t_step'])} | {x['trained_steps']}/{x['timed_steps']} |")
    return lp, st


def _g(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if x == 0:
        return "0"
    return f"{x:.3g}"


def _overhead(native: float, ours: float) -> str:
    if not native or math.isnan(native) or math.isnan(ours):
        return "–"
    return f"{(ours / native - 1) * 100:+.1f}%"


def render_tables(runs: list[dict], out_dir: str | Path, run_name: str) -> dict:
    out_dir = Path(out_dir)
    P = pooled(runs)
    families = sorted({f for f, _ in P})
    lp = [f"# Rollout vs trainer logprob difference ({run_name})", "",
          "|Δlogprob| between the engine's sampled-token logprobs and the trainer's recomputed ones, per RL "
          "step; mean = mean of per-step means, std = mean of per-step stds, max = largest per-step max, "
          "equal = fraction of tokens with bitwise-identical logprobs. Anchor (seed paper): native 1.6e-2 "
          "mean, 5.07 max; IsoExec ≤ 6.7e-7 mean.", "",
          "| family | native mean | native std | native max | native equal | IsoExec mean | IsoExec std | "
          "IsoExec max | IsoExec equal | steps (native/IsoExec) |", "|" + "---|" * 10]
    st = [f"# Step time, native vs IsoExec ({run_name})", "",
          "Mean seconds per RL step over steps ≥ 1 (step 0 compiles kernels and captures CUDA graphs; it is "
          "shown on its own row and kept out of the means). Policy training = the mini-batch updates (as verl "
          "counts it); pre-update scoring is its own row. Policy training and full step average only the steps "
          "that trained (a step whose groups were all dropped by dynamic sampling trains nothing); the last "
          "row counts those steps. Generation is also given per 1k generated tokens, since paired runs "
          "generate different lengths. The device is synchronised at every stage boundary. Anchor (seed "
          "paper): IsoExec +31.3% generation, +18.6% training, +25.3% full step.", "",
          "| family | stage | native s | IsoExec s | overhead |", "|---|---|---|---|---|"]
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["family", "arm", "composition", "seeds", "steps", "dlp_mean", "dlp_std", "dlp_max", "equal_frac",
                "reward", "t_gen", "t_gen_1k", "t_score", "t_train", "t_step", "t_step0", "trained_steps",
                "untrained_steps", "compile_steps"])
    for f in families:
        n, i = headline_arm(P, f, "native"), headline_arm(P, f, "isoexec")
        def cell(x, k):
            return _g(x[k]) if x else "–"
        lp.append(f"| {f} | {cell(n, 'dlp_mean')} | {cell(n, 'dlp_std')} | {cell(n, 'dlp_max')} | "
                  f"{cell(n, 'equal_frac')} | {cell(i, 'dlp_mean')} | {cell(i, 'dlp_std')} | {cell(i, 'dlp_max')} | "
                  f"{cell(i, 'equal_frac')} | {n['steps'] if n else 0}/{i['steps'] if i else 0} |")
        for stage, k in (("generation", "t_gen"), ("generation per 1k tokens", "t_gen_1k"),
                         ("pre-update scoring", "t_score"), ("policy training", "t_train"), ("full step", "t_step"),
                         ("step 0 (compile, capture)", "t_step0")):
            st.append(f"| {f} | {stage} | {cell(n, k)} | {cell(i, k)} | "
                      f"{_overhead(n[k], i[k]) if n and i else '–'} |")
        def counts(x):
            return f"{x['trained_steps']}/{x['timed_steps']}" if x else "–"
        st.append(f"| {f} | steps that trained / timed steps (≥ 1) | {counts(n)} | {counts(i)} | |")
        if any(x and x.get("compile_steps") is not None for x in (n, i)):
            def compiled(x):
                return f"{x['compile_steps']}/{x['timed_steps']}" if x and x.get("compile_steps") is not None else "–"
            st.append(f"| {f} | steps that compiled kernels / timed steps (≥ 1) | {compiled(n)} | {compiled(i)} | |")
    for (f, a) in sorted(P):   # every arm, headline or not
        x = P[(f, a)]
        w.writerow([f, a, x["composition"], x["seeds"], x["steps"], x["dlp_mean"], x["dlp_std"], x["dlp_max"],
                    x["equal_frac"], x["reward"], x["t_gen"], x["t_gen_1k"], x["t_score"], x["t_train"],
                    x["t_step"], x["t_step0"], x["trained_steps"], x["untrained_steps"], x["compile_steps"]])
    arm_lp, arm_st = _arm_sections(P)
    lp += arm_lp
    ds = sorted({str(r.get("settings", {}).get("dynamic_sampling")) for r in runs if "dynamic_sampling" in
                 r.get("settings", {})})
    if ds:
        st += ["", "Dynamic sampling in these runs: " + ", ".join({"True": "on", "False": "off (every step trains "
                                                                  "every group)"}.get(x, x) for x in ds) + "."]
    st += arm_st
    atomic_write(out_dir / "logprob_diff.md", "\n".join(lp) + "\n")
    atomic_write(out_dir / "step_time.md", "\n".join(st) + "\n")
    atomic_write(out_dir / "runs.csv", buf.getvalue())
    render_figures(runs, P, out_dir)
    return P


def render_figures(runs: list[dict], P: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for r in runs:
        xs = [s["step"] for s in r["steps"]]
        ys = [max(s["logprob_abs_diff_mean"], ZERO_FLOOR) for s in r["steps"]]
        style = "-" if r["composition"] == "native" else "--"
        ax.plot(xs, ys, style, marker="o", ms=3, label=f"{r['family']} {r.get('arm', r['composition'])} s{r['seed']}")
    ax.axhline(ZERO_FLOOR, color="grey", lw=0.8)
    ax.text(0.01, ZERO_FLOOR * 2, "exactly 0", transform=ax.get_yaxis_transform(), color="grey", fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean |Δlogprob| (rollout vs trainer)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, out_dir / "logprob_diff.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    stages = (("generation", "t_gen"), ("scoring", "t_score"), ("training", "t_train"), ("full step", "t_step"))
    # native arms first, then the rest, so the default pair keeps its native-then-IsoExec order
    keys = sorted(P, key=lambda k: (k[0], P[k]["composition"] != "native", k[1]))
    width = 0.8 / (len(keys) or 1)
    for bi, (f, a) in enumerate(keys):
        ax.bar([j + bi * width for j in range(len(stages))], [P[(f, a)][k] for _, k in stages], width,
               label=f"{f} {a}")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(stages))], [s for s, _ in stages])
    ax.set_ylabel("seconds per step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, out_dir / "step_time.png")
    plt.close(fig)


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.replace(path)
