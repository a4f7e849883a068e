"""`isoexec plan`: the table on stdout (and as markdown with --markdown), exit 0 when every run fits
and 1 when one does not; bad input is one line on stderr naming the problem, exit 2, no traceback."""

import pytest
import yaml

from isoexec.cli import main

SETTINGS = {"prompts_per_step": 4, "samples_per_prompt": 2, "mini_batch_size": 2, "max_prompt_tokens": 24,
            "max_response_tokens": 16, "overlong_cache": 4}


def _config(tmp_path, text=None, **over):
    d = {"run_name": "t", "arch": "cpu", "families": ["dense"], "models": {"dense": "dense_tiny"},
         "rl": {"settings": dict(SETTINGS)}}
    d.update(over)
    p = tmp_path / "wf.yaml"
    p.write_text(text if text is not None else yaml.safe_dump(d))
    return str(p)


def _refused(capsys, argv, *needles):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("isoexec: error: ") and "Traceback" not in err, err
    for n in needles:
        assert n in err, err


def test_a_run_that_fits_exits_0_and_writes_the_same_table_as_markdown(tmp_path, capsys):
    md = tmp_path / "plan.md"
    assert main(["plan", "--config", _config(tmp_path), "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    assert "Per GPU, GiB:" in out and "fits, " in out and f"wrote {md}" in out
    text = md.read_text()
    assert text.startswith("Made by `isoexec plan --config ") and "| dense | isoexec, native |" in text
    row = next(line for line in out.splitlines() if line.startswith("dense ") and "fits" in line)
    assert row.split()[-3:] == next(line for line in text.splitlines()
                                    if line.startswith("| dense | isoexec")).strip("| ").split(" | ")[-1].split()[-3:]


def test_a_kv_pool_larger_than_the_gpu_exits_1(tmp_path, capsys):
    rl = {"settings": {**SETTINGS, "engine": {"num_pages": 10**8}}}
    assert main(["plan", "--config", _config(tmp_path, rl=rl)]) == 1
    out = capsys.readouterr().out
    assert "does not fit: over by " in out and "engine.num_pages <= " in out


def test_the_gpu_memory_option_replaces_the_default(tmp_path, capsys):
    assert main(["plan", "--config", _config(tmp_path), "--gpu-memory-gib", "0.001"]) == 1
    out = capsys.readouterr().out
    assert "GPU memory: 0.001 GiB per GPU (--gpu-memory-gib)" in out and "does not fit" in out
    assert main(["plan", "--config", _config(tmp_path)]) == 0
    assert "GPU memory: 80 GiB per GPU (default for arch cpu" in capsys.readouterr().out


def test_the_configs_gpu_memory_replaces_the_default_and_the_option_replaces_it(tmp_path, capsys):
    assert main(["plan", "--config", _config(tmp_path, gpu_memory_gib=0.001)]) == 1
    out = capsys.readouterr().out
    assert "GPU memory: 0.001 GiB per GPU (gpu_memory_gib of the config; --gpu-memory-gib overrides it)" in out
    assert "does not fit" in out
    assert main(["plan", "--config", _config(tmp_path, gpu_memory_gib=0.001), "--gpu-memory-gib", "80"]) == 0
    assert "GPU memory: 80 GiB per GPU (--gpu-memory-gib)" in capsys.readouterr().out


@pytest.mark.parametrize("value,needle", [(0, "0 is less than or equal to the minimum of 0"),
                                          (-1, "-1 is less than or equal to the minimum of 0"),
                                          ("lots", "'lots' is not of type 'number'"),
                                          (True, "True is not of type 'number'")])
def test_a_bad_gpu_memory_in_the_config_is_one_line(tmp_path, capsys, value, needle):
    _refused(capsys, ["plan", "--config", _config(tmp_path, gpu_memory_gib=value)], "$.gpu_memory_gib", needle)


def test_an_unknown_config_path_is_one_line(tmp_path, capsys):
    _refused(capsys, ["plan", "--config", str(tmp_path / "nope.yaml")], "nope.yaml", "not found")


def test_malformed_yaml_is_one_line(tmp_path, capsys):
    _refused(capsys, ["plan", "--config", _config(tmp_path, text="run_name: [t\n")], "not valid YAML", "line")


def test_a_config_that_is_not_a_mapping_is_one_line(tmp_path, capsys):
    _refused(capsys, ["plan", "--config", _config(tmp_path, text="- a\n- b\n")], "must be a mapping")


@pytest.mark.parametrize("over,needles", [
    ({"gpus": "eight"}, ("$.gpus", "'eight' is not of type 'integer'")),
    ({"rl": {"settings": {**SETTINGS, "prompts_per_step": 2.5}}},
     ("$.rl.settings.prompts_per_step", "2.5 is not of type 'integer'")),
    ({"rl": {"settings": {**SETTINGS, "engine": {"num_pages": "many"}}}}, ("$.rl.settings.engine.num_pages",)),
    ({"families": ["dense", "bogus"]}, ("$.families[1]", "'bogus' is not one of")),
])
def test_a_value_of_the_wrong_type_is_one_line(tmp_path, capsys, over, needles):
    _refused(capsys, ["plan", "--config", _config(tmp_path, **over)], *needles)


def test_an_unknown_model_is_one_line(tmp_path, capsys):
    _refused(capsys, ["plan", "--config", _config(tmp_path, models={"dense": "dense_nope"})],
             "unknown model 'dense_nope'")


def test_a_bad_gpu_memory_and_an_unwritable_markdown_path_are_one_line(tmp_path, capsys):
    _refused(capsys, ["plan", "--config", _config(tmp_path), "--gpu-memory-gib", "0"], "--gpu-memory-gib")
    (tmp_path / "afile").write_text("x")
    _refused(capsys, ["plan", "--config", _config(tmp_path), "--markdown", str(tmp_path / "afile" / "p.md")],
             "is a file")
