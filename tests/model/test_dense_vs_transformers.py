"""The unified dense model matches transformers 5.17 Qwen3ForCausalLM (and, for a qwen2 config,
Qwen2ForCausalLM) on the same weights."""

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_dense import hf_dense, logprob_rel_error, ours_from_hf  # noqa: E402
from isoexec.compose import build_contract, load_model_config  # noqa: E402
from isoexec.model import build_model, load_dense_checkpoint, load_from_hf_model  # noqa: E402
from isoexec.model.loading import CheckpointError  # noqa: E402

TINY = dict(model_type="qwen3", vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
            max_position_embeddings=512, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True)


@pytest.mark.parametrize("composition", ["isoexec", "native"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("model", [None, "dense_qwen2_tiny"], ids=["qwen3", "qwen2"])
def test_dense_logprobs_match_transformers(composition, dtype, tol, tied, model):
    cfg = dict(TINY if model is None else load_model_config(model)["hf_config"], tie_word_embeddings=tied)
    hf = hf_dense(cfg, dtype)
    err = logprob_rel_error(hf, ours_from_hf(hf, cfg, dtype, composition, model), cfg["vocab_size"])
    assert err < tol, err


def test_safetensors_checkpoint_round_trip(tmp_path):
    hf = hf_dense(TINY)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")  # sharded: index + several files
    assert (tmp_path / "model.safetensors.index.json").exists()
    a = build_model("dense", TINY)
    load_dense_checkpoint(a, tmp_path)
    b = build_model("dense", TINY)
    load_from_hf_model(b, hf)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p.view(torch.int32), q.view(torch.int32)), n


def test_checkpoint_errors_name_the_problem(tmp_path):
    hf = hf_dense(TINY)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    m = build_model("dense", TINY)
    with pytest.raises(CheckpointError, match="not found"):
        load_dense_checkpoint(m, tmp_path / "missing")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.rename(tmp_path / "gone.bin")
    with pytest.raises(CheckpointError, match="shard file\\(s\\) missing"):
        load_dense_checkpoint(m, tmp_path)
    wrong = dict(TINY, intermediate_size=128)
    with pytest.raises(CheckpointError, match="has shape"):
        load_from_hf_model(build_model("dense", wrong), hf)
    from safetensors.torch import save_file

    sd = {k: v.clone().contiguous() for k, v in hf.state_dict().items()
          if "layers.1.mlp.up_proj" not in k and k != "lm_head.weight"}
    single = tmp_path / "single"
    single.mkdir()
    save_file(sd, str(single / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing, first 'model.layers.1.mlp.up_proj.weight'"):
        load_dense_checkpoint(m, single)


def test_contract_of_other_family_is_refused():
    from dataclasses import replace

    from isoexec.errors import BindingRefused

    m = build_model("dense", TINY)
    c = build_contract("dense", "isoexec", "cpu")
    with pytest.raises(BindingRefused, match="contract is for the hybrid family"):
        m.install(replace(c, model=replace(c.model, family="hybrid")))
