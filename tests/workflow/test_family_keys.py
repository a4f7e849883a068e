"""The workflow's per-family keys: `rl.family_settings` (RL settings overrides between `rl.settings`
and an arm's) and `gates.models` (the model the gates rule runs a family's gates with), their
one-line refusals, and why a gate model of the run model's layer dimensions admits the run model's
contract."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow" / "scripts"))

import config_checks  # noqa: E402
from test_workflow import copy_workflow, refusal_line, snakemake, write_config  # noqa: E402

SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"
FAMILIES = config_checks.known_families(SCHEMA)


def test_the_family_list_is_the_schemas():
    assert sorted(FAMILIES) == ["dense", "hybrid", "hybrid_moe", "mla_moe"]


# ------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("config,line", [
    ({"rl": {"family_settings": {"moe": {"trainer_ep": 8}}}},
     "config: rl.family_settings: 'moe' is not a family (one of dense, mla_moe, hybrid, hybrid_moe)"),
    ({"rl": {"family_settings": [8]}}, "config: `rl.family_settings` must map a family to its RL settings overrides"),
    ({"rl": {"family_settings": {"mla_moe": 8}}},
     "config: rl.family_settings.mla_moe must be a mapping of RL settings, got 8"),
    ({"gates": {"models": {"moe": "mla_moe_tiny"}}},
     "config: gates.models: 'moe' is not a family (one of dense, mla_moe, hybrid, hybrid_moe)"),
    ({"gates": {"models": "dense_tiny"}}, "config: `gates.models` must map a family to a model config"),
    ({"gates": {"models": {"dense": 3}}}, "config: gates.models.dense must be a model config name or YAML path, got 3"),
    ({"gates": {"models": {"dense": "dense_nosuch"}}},
     "config: gates.models.dense: 'dense_nosuch' is not a model config (configs/models/dense_nosuch.yaml is missing"),
    ({"gates": {"models": {"dense": "mla_moe_tiny"}}},
     "config: gates.models.dense: 'mla_moe_tiny' is a mla_moe model, not dense"),
    ({"models": {"dense": "dense_qwen3_8b"}, "gates": {"models": {"dense": "dense_qwen3_0p6b"}}},
     "config: gates.models.dense: 'dense_qwen3_0p6b' has other layer dimensions than models.dense 'dense_qwen3_8b' "
     "(hidden_size 1024 vs 4096, intermediate_size 3072 vs 12288"),
])
def test_bad_per_family_keys_are_one_line(config, line, monkeypatch):
    monkeypatch.chdir(REPO)   # model names resolve in configs/models/, as in the workflow's folder
    err = config_checks.per_family_error({"models": {"dense": "dense_tiny"}, **config}, SCHEMA)
    assert err is not None and err.startswith(line) and "\n" not in err, err


def test_good_per_family_keys_pass(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = yaml.safe_load((REPO / "configs/h200x8.yaml").read_text())
    assert config_checks.per_family_error(cfg, SCHEMA) is None
    # a family not in `families` may be named (a base config's entry for a family this run leaves out)
    cfg = {"families": ["dense"], "models": {"dense": "dense_tiny"},
           "rl": {"family_settings": {"mla_moe": {"trainer_ep": 2}}}, "gates": {"models": {"hybrid": "hybrid_tiny"}}}
    assert config_checks.per_family_error(cfg, SCHEMA) is None


@pytest.mark.parametrize("text,line", [
    ("rl: {family_settings: {moe: {trainer_ep: 8}}}\n",
     "config: rl.family_settings: 'moe' is not a family (one of dense, mla_moe, hybrid, hybrid_moe)"),
    ("gates: {models: {mla_moe: mla_moe_glm47_flash_dims}}\n",
     "config: gates.models.mla_moe: 'mla_moe_glm47_flash_dims' has other layer dimensions than models.mla_moe "
     "'mla_moe_tiny'"),
])
def test_the_workflow_refuses_them_with_one_line_before_any_job(tmp_path, text, line):
    wf = copy_workflow(tmp_path)
    bad = write_config(wf / "bad.yaml", text)
    r = snakemake(wf, "-n", "--cores", "1", "--configfile", str(bad))
    out = r.stdout + r.stderr
    assert r.returncode != 0
    got = [ln for ln in out.splitlines() if ln.startswith("config: ")]
    assert len(got) == 1 and got[0].startswith(line), out[-2000:]
    assert "Traceback" not in out and "Failed validating" not in out and "rule " not in out
    assert not (wf / "results").exists()   # nothing written, not even the code version


def test_settings_of_the_wrong_type_are_refused_by_the_schema(tmp_path):
    from test_workflow import schema_error

    wf = copy_workflow(tmp_path)
    text = "rl: {family_settings: {mla_moe: {trainer_ep: eight}}}\n"
    assert "'eight' is not of type 'integer'" in schema_error(wf, text)
    assert "'family' should not be valid under" in schema_error(wf, "rl: {family_settings: {dense: {family: dense}}}\n")
    assert "'tis_cap' was unexpected" in schema_error(wf, "rl: {family_settings: {dense: {train: {tis_cap: 2}}}}\n")


# ------------------------------------------------------------------------------- runs and gates
FAKE_CLI = """\
#!{python}
# Stands in for the CLI (and for torchrun): contracts are stubs, the gates pass with none run, the
# data set is an empty file, and a run writes one metrics line; nothing is computed.
import json, pathlib, sys
args = sys.argv[1:]
if args[:1] == ["--standalone"]:            # torchrun --standalone --nproc_per_node=N -m isoexec.cli ...
    args = args[args.index("isoexec.cli") + 1:]
out = pathlib.Path(args[args.index("--out") + 1]) if "--out" in args else None
if args[:2] == ["contract", "build"] or args[:2] == ["data", "synthetic"]:
    out.write_text("{{}}")
elif args[:2] == ["contract", "verify"]:
    print(json.dumps({{"admitted": True}}))
elif args[:2] == ["gates", "run"]:
    print(json.dumps({{"passed": True, "gates": []}}))
elif args[:1] == ["run"]:
    (out / "metrics.jsonl").write_text("{{}}\\n")
    print(json.dumps({{"steps_run": 1}}))
else:
    sys.exit("fake isoexec: " + " ".join(args))
"""


def test_each_familys_runs_get_its_settings_and_its_gates_their_model(tmp_path):
    """configs/h200x8.yaml with per-family settings, run with a stand-in CLI: each run's
    rl_config.json is rl.settings, then its family's overrides (train merged key by key), then its
    arm's (engine_tp 2 over the family's 4); the gates of each family ran its gates.models entry."""
    wf = copy_workflow(tmp_path)
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    for name in ("isoexec", "torchrun"):
        (bindir / name).write_text(FAKE_CLI.format(python=sys.executable))
        (bindir / name).chmod(0o755)
    extra = write_config(wf / "per_family.yaml", """\
        rl:
          family_settings:
            mla_moe: {trainer_ep: 8, engine_tp: 4, train: {lr: 2.0e-6}}
        """)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
           "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(8))), "ISOEXEC_GPU_LOCK_DIR": str(tmp_path / "locks")}
    runs = [f"res/h200x8/runs/{f}/{a}/seed0" for f in ("dense", "mla_moe") for a in ("native", "isoexec")]
    r = snakemake(wf, *runs, "--cores", "2", "--resources", "gpu=8", "--configfile", "configs/h200x8.yaml",
                  str(extra), "--config", "results_dir=res", env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cfg = yaml.safe_load((REPO / "configs/h200x8.yaml").read_text())
    shared = cfg["rl"]["settings"]
    for run in runs:
        s = json.loads((wf / run / "rl_config.json").read_text())
        fam = run.split("/")[3]
        assert s["engine_tp"] == 2 and s["steps"] == shared["steps"], run        # the arm's, and rl.settings'
        own = cfg["rl"].get("family_settings", {}).get(fam, {}).get("train", {})   # the config's own per family
        assert s["train"] == {**shared["train"], **own, **({"lr": 2.0e-6} if fam == "mla_moe" else {})}, run
        # dense keeps its layers gathered from forward to backward, the MoE families do not
        assert s["train"].get("reshard_after_forward", True) is (fam != "dense"), run
        assert s.get("trainer_ep", 1) == (8 if fam == "mla_moe" else 1), run
    for fam in ("dense", "mla_moe"):
        rec = json.loads((wf / f"res/h200x8/gate_runs/{fam}.json").read_text())
        want = cfg["gates"]["models"][fam]
        assert rec["model"] == want and rec["command"][rec["command"].index("--model") + 1] == want, rec
        assert want.endswith("_dims") and want != cfg["models"][fam]
    # the runs and the contracts keep the run models
    assert {json.loads((wf / run / "rl_config.json").read_text())["model"] for run in runs} == {
        cfg["models"]["dense"], cfg["models"]["mla_moe"]}


# ------------------------------------------------------------------------------- why gates.models is sound
def _gate_models(name: str) -> list[tuple[str, str, str]]:
    cfg = yaml.safe_load((REPO / "configs" / name).read_text())
    return [(f, cfg["models"][f], m) for f, m in (cfg["gates"].get("models") or {}).items()]


@pytest.mark.parametrize("family,run_model,gate_model", _gate_models("h200x8.yaml"))
def test_a_gate_model_gives_the_run_models_contract_entries_and_shapes(family, run_model, gate_model):
    """A shipped gates.models entry: its contract entries (region, kernel, constants: what admission
    matches) and its numerical policy (the whole-model gates' impl version) are the run model's, and so
    are the shapes the kernel gates read from the model config (every hf_config key but the layer
    count; the same kinds of layer)."""
    from isoexec.compose import build_contract, load_model_config
    from isoexec.gates.artifacts import entry_key

    run, gate = load_model_config(run_model), load_model_config(gate_model)
    assert config_checks.layer_dimensions(run["hf_config"]) == config_checks.layer_dimensions(gate["hf_config"])
    assert gate["hf_config"]["num_hidden_layers"] < run["hf_config"]["num_hidden_layers"]
    a, b = (build_contract(family, "isoexec_tp4", "sm90", m) for m in (run_model, gate_model))
    assert sorted(map(entry_key, a.composition)) == sorted(map(entry_key, b.composition))
    assert a.identities.numerical_policy == b.identities.numerical_policy
    assert a.model.config_digest != b.model.config_digest


def test_admission_does_not_read_the_model_the_gates_ran_on(tmp_path):
    """Admission matches artifacts by region, kernel and constants (docs/contract.md): passing artifacts
    written for the contract of one model admit the contract of another model of the same layer
    dimensions. Were admission to check the model, gates.models would need revisiting."""
    from isoexec.compose import build_contract
    from isoexec.gates.artifacts import verify_contract, write_artifact
    from isoexec.gates.kinds import gate_families_for

    gate_contract = build_contract("dense", "isoexec_tp4", "cpu", "dense_tp_tiny")
    for e in gate_contract.composition:
        for fam in gate_families_for(e):
            write_artifact(tmp_path, {
                "gate": {"family": fam, "region": sorted(e.region),
                         "impl": {"id": e.impl.id, "version": e.impl.version, "arch": e.impl.arch},
                         "constants": dict(e.constants), "shapes": {}, "dtype": "float32", "seed": 0, "hazards": []},
                "expect": "invariant", "verdict": "pass", "counts": {}, "env": {"date": "2026-01-01"}})
    hf = yaml.safe_load((REPO / "configs/models/dense_tp_tiny.yaml").read_text())
    hf["hf_config"]["num_hidden_layers"] += 1
    other = tmp_path / "more_layers.yaml"
    other.write_text(yaml.safe_dump(hf))
    run_contract = build_contract("dense", "isoexec_tp4", "cpu", str(other))
    assert run_contract.model.config_digest != gate_contract.model.config_digest
    checks = verify_contract(run_contract, tmp_path)
    assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert re.fullmatch(r"[0-9a-f]{64}", next(p.stem for p in tmp_path.glob("*.json")))


def test_the_shared_warmup_is_compared_per_family(tmp_path):
    """Each family warms up once, shared by its arms, so a setting the warm-up reads may differ between
    families (rl.family_settings) but not between the arms of one family: arms that differ only where
    a family's own setting does not even them out are refused for the other families, named."""
    wf = copy_workflow(tmp_path)
    ok = write_config(wf / "ok.yaml", """\
        families: [dense, hybrid, mla_moe]
        rl: {family_settings: {dense: {train: {lr: 1.0e-3}}, hybrid: {warmup_sft_steps: 5}}}
        """)
    r = snakemake(wf, "-n", "--cores", "1", "--configfile", str(ok))
    assert r.returncode == 0, r.stderr[-3000:]
    bad = write_config(wf / "bad.yaml", """\
        families: [dense, hybrid, mla_moe]
        rl:
          family_settings: {dense: {train: {lr: 1.0e-3}}}
          arms:
            native: {composition: native, settings: {train: {lr: 1.0e-3}}}
            isoexec: {composition: isoexec}
        """)
    r = snakemake(wf, "-n", "--cores", "1", "--configfile", str(bad))
    line = refusal_line(r, "config: the RL runs cannot start")
    assert ("rl.arms native vs isoexec differ in train.lr (hybrid, mla_moe), which the supervised "
            "warm-up reads") in line and "set them in rl.settings or rl.family_settings" in line, line
