"""The isoexec command line: documented shape, exit codes, one-line errors, no partial outputs."""

import json
import subprocess
import sys
import textwrap

import pytest

CLI = [sys.executable, "-m", "isoexec.cli"]


def run(*args, cwd=None):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("contracts")
    for comp in ("isoexec", "native"):
        r = run("contract", "build", "--family", "dense", "--composition", comp, "--arch", "cpu",
                "--out", str(d / f"{comp}.json"))
        assert r.returncode == 0, r.stderr
    return d


def test_help_lists_commands():
    r = run("--help")
    assert r.returncode == 0 and "contract" in r.stdout and "gates" in r.stdout and "exit codes" in r.stdout
    assert "warmup" in r.stdout
    assert run("contract", "build", "--help").returncode == 0


def test_build_writes_canonical_contract(built):
    from isoexec.contract import decode, encode

    data = (built / "isoexec.json").read_bytes()
    assert encode(decode(data)) == data


def test_show_json(built):
    r = run("contract", "show", str(built / "isoexec.json"), "--json")
    obj = json.loads(r.stdout)
    assert r.returncode == 0 and obj["family"] == "dense" and obj["claims_zero_tolerance"] is True


def test_diff_exit_codes(built):
    same = run("contract", "diff", str(built / "isoexec.json"), str(built / "isoexec.json"))
    assert same.returncode == 0 and "numerical_policy agrees" in same.stdout
    other = run("contract", "diff", str(built / "isoexec.json"), str(built / "native.json"), "--json")
    assert other.returncode == 1
    diffs = json.loads(other.stdout)["differences"]
    assert any(d["where"] == "region lm_head, case engine_decode" and d["field"] == "impl.id" for d in diffs)


def test_verify_without_gates_is_not_admitted(built):
    r = run("contract", "verify", str(built / "isoexec.json"))
    assert r.returncode == 1 and "pending" in r.stdout


def _one_error_line(r):
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines and lines[0].startswith("isoexec: error:"), r.stderr
    assert "Traceback" not in r.stderr


def test_missing_contract_file(tmp_path):
    r = run("contract", "show", str(tmp_path / "nope.json"))
    assert r.returncode == 2
    _one_error_line(r)
    assert "not found" in r.stderr


def test_invalid_json_contract(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    r = run("contract", "verify", str(p))
    assert r.returncode == 2
    _one_error_line(r)
    assert "not valid strict JSON" in r.stderr


def test_unknown_impl_leaves_no_output(tmp_path):
    comp = tmp_path / "c.yaml"
    comp.write_text(textwrap.dedent("""
        name: bad
        entries:
          - {region: [embed], impl: turbo_embed}
    """))
    out = tmp_path / "out.json"
    r = run("contract", "build", "--family", "dense", "--composition", str(comp), "--arch", "cpu", "--out", str(out))
    assert r.returncode == 2
    _one_error_line(r)
    assert "unknown impl 'turbo_embed'" in r.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == [comp]


def test_invalid_yaml_composition(tmp_path):
    comp = tmp_path / "c.yaml"
    comp.write_text("name: [oops\n")
    out = tmp_path / "out.json"
    r = run("contract", "build", "--family", "dense", "--composition", str(comp), "--arch", "cpu", "--out", str(out))
    assert r.returncode == 2 and "not valid YAML" in r.stderr and not out.exists()


def test_existing_output_untouched_on_refusal(tmp_path):
    out = tmp_path / "out.json"
    out.write_text("previous")
    r = run("contract", "build", "--family", "dense", "--composition", "nope", "--arch", "cpu", "--out", str(out))
    assert r.returncode == 2 and out.read_text() == "previous"


def test_usage_error_is_exit_2():
    assert run("contract", "build", "--family", "dense").returncode == 2
    assert run("contract", "build", "--family", "nope", "--composition", "isoexec", "--arch", "cpu",
               "--out", "x").returncode == 2


def test_gates_only_runs_the_named_gates_and_refuses_unknown_names(tmp_path):
    bad = run("gates", "run", "--family", "dense", "--composition", "isoexec", "--out", str(tmp_path / "bad"),
              "--only", "backward_determinism,no_such_gate")
    assert bad.returncode == 2 and not (tmp_path / "bad").exists()
    assert bad.stderr.count("\n") == 1 and "no_such_gate" in bad.stderr and "Traceback" not in bad.stderr
    ok = run("gates", "run", "--family", "dense", "--composition", "isoexec", "--out", str(tmp_path / "g"),
             "--only", "backward_determinism", "--json")
    assert ok.returncode == 0, ok.stderr
    gates = json.loads(ok.stdout)["gates"]
    assert gates and {g["family"] for g in gates} == {"backward_determinism"}
    assert all(g["verdict"] == "pass" and g["differing"] == 0 and g["compared"] > 0 for g in gates)


# `isoexec run --config` with a bad value: one line on stderr naming the key, exit 2, no traceback,
# and no output folder (every value is checked before any work starts). Keys, types and ranges are
# checked by the packaged schema (isoexec/rl/config.schema.yaml), the rest by RLConfig._check.
BAD_RL_CONFIGS = [
    ("steps: banana\n", "rl config: $.steps: 'banana' is not of type 'integer'"),
    ("steps: null\n", "rl config: $.steps: None is not of type 'integer'"),
    ("steps: 0\n", "rl config: $.steps: 0 is less than the minimum of 1"),
    ("rl: 5\n", "`rl` must be a mapping of RL settings, got 5"),
    ("engine: {bogus: 1}\n", "rl config: $.engine: Additional properties are not allowed ('bogus' was unexpected)"),
    ("engine: [1, 2]\n", "rl config: $.engine: [1, 2] is not of type 'object'"),
    ("dtype: float7\n", "rl config: $.dtype: 'float7' is not one of ['auto', 'float32', 'bfloat16']"),
    ("temperature: hot\n", "rl config: $.temperature: 'hot' is not of type 'number'"),
    ("temperature: .nan\n", "rl config: $.temperature: nan is not of type 'number'"),
    ("rl: {train: {tis_threshold: high}}\n", "rl config: $.train.tis_threshold: 'high' is not of type 'number', 'null'"),
    ("wandb: {enabled: yes please}\n", "rl config: $.wandb.enabled: 'yes please' is not of type 'boolean'"),
    ("synthetic: {n: 10, max_operands: 9}\n", "rl config: $.synthetic: Additional properties are not allowed"),
    # what the schema cannot say: checks across keys
    ("prompts_per_step: 2\nmini_batch_size: 4\n", "rl config: mini_batch_size 4 counts prompts"),
    ("max_response_tokens: 8\n", "rl config: overlong_cache must be smaller than max_response_tokens"),
    ("engine: {chunk_align: 4096}\n", "rl config: `engine`: max_num_batched_tokens (2048) must be >= chunk_align"),
    ("synthetic: {min_terms: 3, max_terms: 2}\n", "rl config: `synthetic`: synthetic_arithmetic: need 1 <= min_terms"),
]


@pytest.mark.parametrize("text,message", BAD_RL_CONFIGS, ids=[t.strip() for t, _ in BAD_RL_CONFIGS])
def test_run_refuses_a_bad_config_value_in_one_line_and_leaves_nothing(tmp_path, capsys, text, message):
    from isoexec.cli import main

    cfg = tmp_path / "rl.yaml"
    cfg.write_text(text)
    out = tmp_path / "out"
    assert main(["run", "--config", str(cfg), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("isoexec: error: ") and message in err, err
    assert not out.exists()


# The same through the real command (a fresh process): values the schema catches inside a section,
# and a float where an integer is needed (YAML reads 2.0 as a float).
@pytest.mark.parametrize("text,line", [
    ("engine: {max_num_seqs: many}\n", "rl config: $.engine.max_num_seqs: 'many' is not of type 'integer'"),
    ("wandb: {enabled: false, projct: x}\n",
     "rl config: $.wandb: Additional properties are not allowed ('projct' was unexpected)"),
    ("rl: {prompts_per_step: 4.0}\n", "rl config: $.prompts_per_step: 4.0 is not of type 'integer'"),
], ids=["engine-type", "wandb-unknown-key", "float-for-int"])
def test_run_schema_refusals_through_the_command(tmp_path, text, line):
    cfg = tmp_path / "rl.yaml"
    cfg.write_text(text)
    out = tmp_path / "out"
    r = run("run", "--config", str(cfg), "--composition", "isoexec", "--out", str(out))
    assert r.returncode == 2 and r.stderr == f"isoexec: error: {line}\n", r.stderr
    assert not out.exists()


def test_run_bad_config_through_the_installed_command_has_no_traceback(tmp_path):
    cfg = tmp_path / "rl.yaml"
    cfg.write_text("temperature: hot\n")
    r = run("run", "--config", str(cfg), "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr == "isoexec: error: rl config: $.temperature: 'hot' is not of type 'number'\n"
    assert not (tmp_path / "out").exists()


# `isoexec warmup`: the shared warm-up of a run's random model (tests/rl/test_shared_warmup.py has the rest)
WARMUP_BASE = ("prompt_style: compact\nmax_prompt_tokens: 16\nwarmup_batch_size: 4\n"
               "synthetic: {n: 20, max_operand: 9, min_terms: 2, max_terms: 2, ops: '+'}\n")


@pytest.mark.parametrize("text,message", [
    ("warmup_sft_steps: 0\n", "rl config: warmup_sft_steps is 0: there is nothing to warm up"),
    ("warmup_sft_steps: 2\ncheckpoint: some/folder\n", "rl config: checkpoint 'some/folder' is set: a run from a "
     "checkpoint has no warm-up"),
    ("warmup_sft_steps: -1\n", "rl config: $.warmup_sft_steps: -1 is less than the minimum of 0"),
    ("warmup_sft_steps: 2\nwarmup_batch: 4\n", "rl config: $: Additional properties are not allowed ('warmup_batch'"),
], ids=["no-steps", "checkpoint", "negative", "unknown-key"])
def test_warmup_refuses_bad_input_in_one_line_and_leaves_nothing(tmp_path, capsys, text, message):
    from isoexec.cli import main

    cfg = tmp_path / "rl.yaml"
    cfg.write_text(WARMUP_BASE + text)
    out = tmp_path / "out"
    assert main(["warmup", "--config", str(cfg), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("isoexec: error: ") and message in err, err
    assert not out.exists()


def test_warmup_then_run_from_it_and_a_run_of_other_settings_is_refused(tmp_path, capsys):
    """`isoexec warmup` writes the folder and prints one JSON line; `isoexec run --checkpoint` starts
    from it; a run whose settings differ (another seed) is refused in one line before any work."""
    from isoexec.cli import main

    cfg = tmp_path / "rl.yaml"
    cfg.write_text(WARMUP_BASE + "warmup_sft_steps: 2\nsteps: 1\nprompts_per_step: 2\nsamples_per_prompt: 2\n"
                   "mini_batch_size: 1\nmax_response_tokens: 8\noverlong_cache: 2\n")
    w = tmp_path / "w"
    assert main(["warmup", "--config", str(cfg), "--out", str(w)]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["composition"] == "native" and summary["sft_steps"] == 2 and len(summary["weights_sha256"]) == 64
    assert "warm-up SFT: 2 steps" in err
    assert main(["run", "--config", str(cfg), "--checkpoint", str(w), "--out", str(tmp_path / "r")]) == 0
    assert "starting from the shared warm-up" in capsys.readouterr().err
    r1 = tmp_path / "r1"
    assert main(["run", "--config", str(cfg), "--checkpoint", str(w), "--seed", "1", "--out", str(r1)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "is the shared warm-up of another configuration (differs in seed, train.seed)" in err
    assert not r1.exists()
