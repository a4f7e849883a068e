"""The reproduction tables and figures from run metrics."""

import json

from isoexec.rl.tables import find_runs, render_tables


def _write_run(root, family, comp, seed, steps, diff):
    d = root / family / comp / f"seed{seed}"
    d.mkdir(parents=True)
    with open(d / "metrics.jsonl", "w") as f:
        for s in range(steps):
            f.write(json.dumps({"step": s, "logprob_abs_diff_mean": diff * (s + 1), "logprob_abs_diff_std": diff,
                                "logprob_abs_diff_max": diff * 10 * (s + 1), "bitwise_equal_frac": 1.0 if diff == 0
                                else 0.5, "reward_mean": -0.5, "time_generation_s": 2.0 if comp == "native" else 2.2,
                                "time_scoring_s": 0.5, "time_training_s": 1.5, "time_step_s": 4.0 if comp ==
                                "native" else 4.4}) + "\n")


def test_tables_show_native_vs_isoexec_and_overhead(tmp_path):
    runs_dir = tmp_path / "runs"
    _write_run(runs_dir, "dense", "native", 0, 3, 0.01)
    _write_run(runs_dir, "dense", "isoexec", 0, 3, 0.0)
    runs = find_runs(runs_dir)
    assert len(runs) == 2
    out = tmp_path / "fig"
    P = render_tables(runs, out, "cpu")
    assert P[("dense", "isoexec")]["dlp_max"] == 0 and abs(P[("dense", "native")]["dlp_max"] - 0.3) < 1e-12
    lp = (out / "logprob_diff.md").read_text()
    row = next(line for line in lp.splitlines() if line.startswith("| dense"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "0.02" and cells[3] == "0.3" and cells[5] == "0" and cells[7] == "0" and cells[8] == "1"
    st = (out / "step_time.md").read_text()
    assert "| dense | generation | 2 | 2.2 | +10.0% |" in st
    assert "| dense | full step | 4 | 4.4 | +10.0% |" in st
    assert "| dense | pre-update scoring | 0.5 | 0.5 | +0.0% |" in st
    assert "| dense | policy training | 1.5 | 1.5 | +0.0% |" in st
    assert "| dense | steps that trained / timed steps (≥ 1) | 2/2 | 2/2 | |" in st
    for png in ("logprob_diff.png", "step_time.png"):
        assert (out / png).stat().st_size > 1000
    assert len((out / "runs.csv").read_text().splitlines()) == 3


def test_step_time_keeps_step_0_and_untrained_steps_out_of_the_means(tmp_path):
    d = tmp_path / "runs" / "dense" / "isoexec" / "seed0"
    d.mkdir(parents=True)
    base = {"logprob_abs_diff_mean": 0.0, "logprob_abs_diff_std": 0.0, "logprob_abs_diff_max": 0.0,
            "bitwise_equal_frac": 1.0, "reward_mean": 0.0, "time_scoring_s": 0.5, "time_generation_s": 2.0}
    steps = [  # step 0: compile + capture, slow; step 2 kept no group and trained nothing
        dict(base, step=0, trained=True, tokens_generated=1000, time_training_s=9.0, time_step_s=20.0),
        dict(base, step=1, trained=True, tokens_generated=500, time_training_s=1.0, time_step_s=4.0),
        dict(base, step=2, trained=False, tokens_generated=400, time_training_s=0.0, time_step_s=2.5),
        dict(base, step=3, trained=True, tokens_generated=2000, time_training_s=2.0, time_step_s=5.0),
    ]
    with open(d / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in steps)
    P = render_tables(find_runs(tmp_path / "runs"), tmp_path / "fig", "cpu")
    x = P[("dense", "isoexec")]
    assert x["t_train"] == 1.5 and x["t_step"] == 4.5 and x["t_step0"] == 20.0
    assert x["t_gen"] == 2.0 and abs(x["t_gen_1k"] - (4.0 + 5.0 + 1.0) / 3) < 1e-12
    assert x["trained_steps"] == 2 and x["timed_steps"] == 3 and x["untrained_steps"] == 1
    st = (tmp_path / "fig" / "step_time.md").read_text()
    assert "| dense | steps that trained / timed steps (≥ 1) | – | 2/3 | |" in st
    assert "| dense | step 0 (compile, capture) | – | 20 | – |" in st


def test_each_arm_gets_its_own_rows(tmp_path):
    """VeXact-style arms (native, native + TIS, native + TIS + K3 rejection, IsoExec): the headline
    columns stay native vs IsoExec, and a per-arm section lists every arm with its composition."""
    runs_dir = tmp_path / "runs"
    for arm, comp, diff in (("native", "native", 0.01), ("native_tis", "native", 0.02),
                            ("native_tis_k3", "native", 0.04), ("isoexec", "isoexec", 0.0)):
        _write_run(runs_dir, "dense", arm, 0, 3, diff)
        (runs_dir / "dense" / arm / "seed0" / "rl_config.json").write_text(json.dumps({"composition": comp}))
    runs = find_runs(runs_dir)
    P = render_tables(runs, tmp_path / "fig", "cpu")
    assert set(P) == {("dense", a) for a in ("native", "native_tis", "native_tis_k3", "isoexec")}
    assert P[("dense", "native_tis_k3")]["composition"] == "native"
    lp = (tmp_path / "fig" / "logprob_diff.md").read_text()
    assert "## Per arm" in lp
    assert "| dense | native_tis | native | 0.04 | 0.02 | 0.6 | 0.5 | 3 |" in lp
    assert "| dense | isoexec | isoexec | 0 | 0 | 0 | 1 | 3 |" in lp
    head = next(line for line in lp.splitlines() if line.startswith("| dense"))
    assert [c.strip() for c in head.strip("|").split("|")][3] == "0.3"      # headline native = the arm "native"
    st = (tmp_path / "fig" / "step_time.md").read_text()
    assert "| dense | native_tis_k3 | native | 2.2 | 0.5 | 1.5 | 4.4 | 2/2 |" in st   # _write_run times by folder name
    csv_rows = (tmp_path / "fig" / "runs.csv").read_text().splitlines()
    assert csv_rows[0].startswith("family,arm,composition") and len(csv_rows) == 5


def test_steps_that_compiled_kernels_are_counted_when_the_metrics_record_it(tmp_path):
    d = tmp_path / "runs" / "dense" / "isoexec" / "seed0"
    d.mkdir(parents=True)
    base = {"logprob_abs_diff_mean": 0.0, "logprob_abs_diff_std": 0.0, "logprob_abs_diff_max": 0.0,
            "bitwise_equal_frac": 1.0, "reward_mean": 0.0, "time_scoring_s": 0.5, "time_generation_s": 2.0,
            "time_training_s": 1.0, "time_step_s": 4.0, "trained": True}
    compiled = [12, 0, 3, 0]   # step 0 compiles (kept out of the count like out of the means), step 2 compiled 3
    with open(d / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(dict(base, step=s, kernels_compiled=c)) + "\n" for s, c in enumerate(compiled))
    P = render_tables(find_runs(tmp_path / "runs"), tmp_path / "fig", "cpu")
    assert P[("dense", "isoexec")]["compile_steps"] == 1
    st = (tmp_path / "fig" / "step_time.md").read_text()
    assert "| dense | steps that compiled kernels / timed steps (≥ 1) | – | 1/3 | |" in st


def test_metrics_without_a_compile_count_render_no_compile_row(tmp_path):
    runs_dir = tmp_path / "runs"
    _write_run(runs_dir, "dense", "native", 0, 3, 0.01)
    _write_run(runs_dir, "dense", "isoexec", 0, 3, 0.0)
    P = render_tables(find_runs(runs_dir), tmp_path / "fig", "cpu")
    assert P[("dense", "isoexec")]["compile_steps"] is None
    assert "compiled kernels" not in (tmp_path / "fig" / "step_time.md").read_text()


def test_a_pair_under_tensor_parallelism_fills_the_headline_columns(tmp_path):
    """Arms of native_tp4 and isoexec_tp4 (the engine at TP > 1) are the headline pair when no arm
    runs plain native or isoexec; an unrelated composition name is on neither side."""
    from isoexec.rl.tables import composition_side

    runs_dir = tmp_path / "runs"
    for arm, comp, diff in (("native_tp2", "native_tp4", 0.01), ("isoexec_tp2", "isoexec_tp4", 0.0)):
        _write_run(runs_dir, "dense", arm, 0, 3, diff)
        (runs_dir / "dense" / arm / "seed0" / "rl_config.json").write_text(json.dumps({"composition": comp}))
    render_tables(find_runs(runs_dir), tmp_path / "fig", "cpu")
    lp = (tmp_path / "fig" / "logprob_diff.md").read_text()
    head = [c.strip() for c in next(x for x in lp.splitlines() if x.startswith("| dense")).strip("|").split("|")]
    assert head[3] == "0.3" and head[7] == "0" and head[-1] == "3/3"     # native_tp4 left, isoexec_tp4 right
    assert [composition_side(c) for c in ("native", "native_tp4", "isoexec_ep4", "nativex", "stock")] == \
        ["native", "native", "isoexec", None, None]
