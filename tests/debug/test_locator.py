"""The first-divergence locator names the region where trainer and engine bits part."""

import sys

sys.modules.setdefault("fla", None)

import torch  # noqa: E402

from isoexec.compose import build_contract  # noqa: E402
from isoexec.debug import first_divergence  # noqa: E402
from isoexec.model import build_model  # noqa: E402
from isoexec.model.batch import ForwardBatch  # noqa: E402

TINY = dict(model_type="qwen3", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, hidden_act="silu",
            max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
TOKENS = list(range(3, 40))


def _pair(composition="isoexec"):
    c = build_contract("dense", composition, "cpu")
    a = build_model("dense", TINY).init_random(1)
    b = build_model("dense", TINY).init_random(1)
    a.install(c)
    b.install(c)
    return a, b


def test_isoexec_has_no_divergence_in_prefill_or_decode():
    a, b = _pair()
    assert first_divergence(a, b, TOKENS, "prefill") is None
    assert first_divergence(a, b, TOKENS, "decode") is None


def _bits(t):
    return t.view(torch.int32)


def _trainer_logprobs(model):
    ids = torch.tensor(TOKENS)
    with torch.no_grad():
        h = model.hidden_states(ids, ForwardBatch.packed([len(TOKENS)], "trainer_score", "cpu"))
        return model.token_logprobs(h, torch.roll(ids, -1), "trainer_score")


def test_a_drifted_weight_is_located_at_its_region_and_layer():
    a, b = _pair()
    wa, wb = a.layers[1].down_weight, b.layers[1].down_weight
    with torch.no_grad():
        # a drift that rounding cannot absorb (one ulp of one weight vanished in the sum on some
        # CPUs): row 0 of layer 1's down_proj scaled by 1.25, so that region's output feature 0
        # moves by a quarter of its value for every token
        wb[0] *= 1.25
        down = a._plan("trainer_score")["down_proj"]
        x = torch.randn(len(TOKENS), TINY["intermediate_size"], generator=torch.Generator().manual_seed(0))
        moved = _bits(down(x, wb)) != _bits(down(x, wa))
    # precondition: the drift changes the region's output (feature 0 only) and reaches the logprobs
    assert moved[:, 0].all() and not moved[:, 1:].any()
    assert (_bits(_trainer_logprobs(a)) != _bits(_trainer_logprobs(b))).any()
    for mode in ("prefill", "decode"):
        d = first_divergence(a, b, TOKENS, mode)
        assert d is not None and d.region == "down_proj" and d.layer == 1, (mode, d)
        assert d.differing > 0 and "layer 1, region down_proj" in str(d)


def test_native_decode_divergence_is_located():
    a, b = _pair("native")
    d = first_divergence(a, b, TOKENS, "decode")
    assert d is not None and d.differing > 0
