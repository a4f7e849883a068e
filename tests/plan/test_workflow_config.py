"""A workflow config is read as the workflow reads it: over configs/config.yaml as Snakemake merges a
--configfile, checked by the workflow's schema, one row per family and distinct arm, the engine a run
builds (rl.loop.engine_config), the model's own family."""

import copy

import pytest
import yaml
from snakemake.utils import update_config

from isoexec.errors import ConfigError
from isoexec.paths import configs_dir
from isoexec.plan.workflow_config import merge_config, read_workflow_config


def _write(tmp_path, data, name="wf.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return str(p)


def tiny(**over):
    d = {"run_name": "t", "arch": "cpu", "families": ["dense"], "models": {"dense": "dense_tiny"},
         "rl": {"settings": {"prompts_per_step": 4, "samples_per_prompt": 2, "mini_batch_size": 2,
                             "max_prompt_tokens": 24, "max_response_tokens": 16, "overlong_cache": 4}}}
    d.update(over)
    return d


@pytest.mark.parametrize("name", ["h200.yaml", "paper.yaml"])
def test_the_merge_is_snakemakes(name):
    base = yaml.safe_load((configs_dir() / "config.yaml").read_text())
    over = yaml.safe_load((configs_dir() / name).read_text())
    want = copy.deepcopy(base)
    update_config(want, over)
    assert merge_config(base, over) == want


def test_a_config_is_merged_over_the_embedded_default(tmp_path):
    wf = read_workflow_config(_write(tmp_path, tiny()))
    assert wf.merged_over and wf.gpus == 1 and wf.rl_enabled    # rl.enabled comes from configs/config.yaml
    (row,) = wf.shapes
    assert row.arms == ("isoexec", "native")                    # equal arms share a row
    assert (row.dtype, row.max_num_seqs, row.num_pages) == ("float32", 8, 8 * 40 // 16 + 64)
    assert row.longest_sequence == 40 and row.micro_batch_budget == 4096


def test_an_arm_with_other_engine_settings_gets_a_row_of_its_own(tmp_path):
    d = tiny()
    d["rl"]["arms"] = {"iso": {"composition": "isoexec"},
                       "small": {"composition": "native", "settings": {"engine": {"num_pages": 100}}}}
    wf = read_workflow_config(_write(tmp_path, d))
    assert [(s.arms, s.num_pages) for s in wf.shapes] == [(("iso",), 8 * 40 // 16 + 64), (("small",), 100)]


def test_activation_checkpointing_is_read_from_the_train_settings_and_shrinks_the_trainer_row(tmp_path):
    from isoexec.plan.rows import plan_row
    d = tiny()
    d["rl"]["settings"]["train"] = {"activation_checkpointing": True}
    (ck,) = read_workflow_config(_write(tmp_path, d)).shapes
    (plain,) = read_workflow_config(_write(tmp_path, tiny(), "plain.yaml")).shapes
    assert ck.activation_checkpointing and not plain.activation_checkpointing
    assert plan_row(ck, 1 << 40).trainer_activations < plan_row(plain, 1 << 40).trainer_activations


def test_reshard_after_forward_false_is_read_per_family_and_grows_the_gathered_weights_by_every_layer(tmp_path):
    """rl.family_settings.<family>.train.reshard_after_forward: false (merged into the train
    settings) makes that family's FSDP2 row hold the root and every layer gathered, not two."""
    from isoexec.plan.rows import plan_row
    over = dict(gpus=2, families=["hybrid"], models={"hybrid": "hybrid_tiny"})
    d = tiny(**over)
    d["rl"]["settings"]["train"] = {"lr": 1e-4}
    d["rl"]["family_settings"] = {"hybrid": {"train": {"reshard_after_forward": False}}}
    kept = read_workflow_config(_write(tmp_path, d)).shapes[0]     # the hybrid arms' engines differ: two rows
    freed = read_workflow_config(_write(tmp_path, tiny(**over), "freed.yaml")).shapes[0]
    assert kept.arms == freed.arms and not kept.reshard_after_forward and freed.reshard_after_forward
    k, f = plan_row(kept, 1 << 40), plan_row(freed, 1 << 40)
    extra = (k.units.layers - 2 * k.units.layer) * 4      # fp32 on arch cpu; hybrid_tiny: four layers
    assert extra > 0 and k.states["weights"] - f.states["weights"] == extra
    assert k.units.gathered_bytes("float32") == 4 * (k.units.root + k.units.layers)


def test_each_engine_is_sized_for_its_engine_groups_deal_of_the_prompts(tmp_path):
    """Prompts are dealt whole to the dp / engine_tp engine groups, so each engine holds the largest
    group's share, ceil(prompts / groups) x samples sequences, and pages for them: the plan reads
    the same rl.loop.engine_config the run builds its engine with."""
    from isoexec.rl.loop import RLConfig, engine_config
    (one,) = read_workflow_config(_write(tmp_path, tiny())).shapes
    (four,) = read_workflow_config(_write(tmp_path, tiny(gpus=4), "four.yaml")).shapes
    d = tiny(gpus=4)
    d["rl"]["settings"]["engine_tp"] = 2
    # the workflow's compositions (isoexec, native) pin tp to 1: the run's cut would refuse engine_tp 2
    with pytest.raises(ConfigError, match="rl settings of dense arm isoexec: topology refused: tp=2 is not in the"):
        read_workflow_config(_write(tmp_path, d, "tp2.yaml"))
    assert (one.max_num_seqs, four.max_num_seqs) == (8, 2)
    assert (one.num_pages, four.num_pages) == (8 * 40 // 16 + 64, 2 * 40 // 16 + 64)
    cfg = RLConfig.from_dict(dict(tiny()["rl"]["settings"], prompts_per_step=6, mini_batch_size=2))
    assert engine_config(cfg, 2).max_num_seqs == 3 * 2        # 4 ranks at engine_tp 2: two engine groups
    assert engine_config(cfg, 4).max_num_seqs == 2 * 2        # 6 prompts over 4 groups: 1, 1, 2, 2


def test_kv_cache_gib_caps_the_plans_kv_pool_as_it_caps_the_runs(tmp_path):
    from isoexec.plan.rows import plan_row
    (free,) = read_workflow_config(_write(tmp_path, tiny())).shapes
    d = tiny()
    d["rl"]["settings"]["kv_cache_gib"] = 1e-4
    (cap,) = read_workflow_config(_write(tmp_path, d, "cap.yaml")).shapes
    assert cap.num_pages < free.num_pages
    assert plan_row(cap, 1 << 40).kv_pool <= 1e-4 * (1 << 30) < plan_row(free, 1 << 40).kv_pool
    d["rl"]["settings"]["kv_cache_gib"] = 1e-7
    with pytest.raises(ConfigError, match="rl settings of dense arm isoexec: rl config: kv_cache_gib=1e-07 holds"):
        read_workflow_config(_write(tmp_path, d, "small.yaml"))


def test_a_world_the_run_would_refuse_is_refused_by_the_plan(tmp_path):
    with pytest.raises(ConfigError, match="a world of 3 ranks must divide prompts_per_step=4"):
        read_workflow_config(_write(tmp_path, tiny(gpus=3)))
    d = tiny(gpus=2)
    d["rl"]["settings"]["engine_tp"] = 4
    with pytest.raises(ConfigError, match="engine_tp=4 does not divide the world of 2 ranks"):
        read_workflow_config(_write(tmp_path, d))


def test_gpus_is_the_data_parallel_size(tmp_path):
    (row,) = read_workflow_config(_write(tmp_path, tiny(gpus=4))).shapes
    assert row.dp == 4


def test_gpus_per_node_times_nodes_is_the_data_parallel_size(tmp_path):
    d = tiny(gpus=4, nodes=2)
    d["rl"]["settings"].update(prompts_per_step=8, mini_batch_size=4)   # 8 ranks take whole groups
    wf = read_workflow_config(_write(tmp_path, d))
    assert (wf.gpus, wf.nodes, wf.dp) == (4, 2, 8) and wf.shapes[0].dp == 8


def test_a_model_of_another_family_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="models.dense is 'hybrid_tiny', a hybrid model"):
        read_workflow_config(_write(tmp_path, tiny(models={"dense": "hybrid_tiny"})))


def test_settings_a_run_would_refuse_are_refused(tmp_path):
    d = tiny()
    d["rl"]["settings"]["mini_batch_size"] = 8
    with pytest.raises(ConfigError, match="rl settings of dense arm isoexec: .*mini_batch_size 8"):
        read_workflow_config(_write(tmp_path, d))


def test_a_pair_under_tensor_parallelism_is_planned_with_its_engine_cut(tmp_path):
    """Arms of the TP compositions (isoexec_tp4: leaf-pinned row-parallel sums; native_tp4: stock
    all-reduce) at engine_tp 2 are planned as the run builds them; plain native at engine_tp 2 is
    refused as the run refuses it."""
    d = tiny(gpus=2, models={"dense": "dense_tp_tiny"}, compositions=["isoexec_tp4", "native_tp4"])
    d["rl"]["settings"]["engine_tp"] = 2
    shapes = read_workflow_config(_write(tmp_path, d)).shapes
    assert sorted(a for s in shapes for a in s.arms) == ["isoexec_tp4", "native_tp4"]
    assert all(s.engine_tp == 2 and s.dp == 2 for s in shapes)
    d["compositions"] = ["native"]
    with pytest.raises(ConfigError, match="rl settings of dense arm native: topology refused: tp=2"):
        read_workflow_config(_write(tmp_path, d, "native.yaml"))


def test_family_settings_come_between_the_shared_settings_and_the_arms(tmp_path):
    """rl.family_settings: a family's overrides over rl.settings (mappings merged key by key), an
    arm's over both; the other families keep rl.settings."""
    d = tiny(families=["dense", "mla_moe"], models={"dense": "dense_tiny", "mla_moe": "mla_moe_tiny"})
    d["rl"]["settings"]["engine"] = {"max_num_seqs": 8}
    d["rl"]["family_settings"] = {"mla_moe": {"engine": {"num_pages": 100}, "max_response_tokens": 24}}
    d["rl"]["arms"] = {"iso": {"composition": "isoexec"},
                       "small": {"composition": "native", "settings": {"engine": {"num_pages": 50}}}}
    rows = {(s.family, s.arms): s for s in read_workflow_config(_write(tmp_path, d)).shapes}
    default_pages = 8 * 40 // 16 + 64
    assert {k: (s.num_pages, s.max_num_seqs, s.longest_sequence) for k, s in rows.items()} == {
        ("dense", ("iso",)): (default_pages, 8, 40), ("dense", ("small",)): (50, 8, 40),
        ("mla_moe", ("iso",)): (100, 8, 48), ("mla_moe", ("small",)): (50, 8, 48)}


def test_trainer_ep_for_the_moe_families_alone(tmp_path):
    """trainer_ep where only the families with routed experts take it: under isoexec_ep4 the mla_moe
    row is planned at ep 2 and hybrid_moe's at ep 1. The same setting for every family would be
    refused for one without routed experts, and the tensor-parallel compositions, which pin ep to 1,
    refuse it for a MoE family (configs/h200x8.yaml's pair: its MoE families cannot take trainer_ep)."""
    d = tiny(arch="sm90", gpus=2, families=["mla_moe", "hybrid_moe"], compositions=["isoexec_ep4"],
             models={"mla_moe": "mla_moe_tiny", "hybrid_moe": "hybrid_moe_tiny"})
    d["rl"]["family_settings"] = {"mla_moe": {"trainer_ep": 2}}
    rows = {s.family: s.trainer_ep for s in read_workflow_config(_write(tmp_path, d)).shapes}
    assert rows == {"mla_moe": 2, "hybrid_moe": 1}
    d = tiny(arch="sm90", gpus=2, families=["mla_moe"], compositions=["isoexec_tp4", "native_tp4"],
             models={"mla_moe": "mla_moe_tp_tiny"})
    d["rl"]["family_settings"] = {"mla_moe": {"trainer_ep": 2}}
    with pytest.raises(ConfigError, match=r"rl settings of mla_moe arm isoexec_tp4: topology refused: ep=2 is not in "
                                          r"the proven domain \[1\]"):
        read_workflow_config(_write(tmp_path, d, "tp4.yaml"))


def test_an_unknown_family_in_family_settings_is_refused_in_one_line(tmp_path):
    d = tiny()
    d["rl"]["family_settings"] = {"moe": {"steps": 2}}
    with pytest.raises(ConfigError, match=r"\$\.rl\.family_settings.*'moe' is not one of") as e:
        read_workflow_config(_write(tmp_path, d))
    assert "\n" not in str(e.value)
    d["rl"]["family_settings"] = {"dense": {"trainer_ep": "eight"}}
    with pytest.raises(ConfigError, match=r"rl\.family_settings\.dense\.trainer_ep: 'eight' is not of type 'integer'"):
        read_workflow_config(_write(tmp_path, d, "type.yaml"))
