"""score_logprobs in training mode (autograd) and scoring mode; gradients flow."""

import sys

sys.modules.setdefault("fla", None)

import torch  # noqa: E402

from isoexec.compose import build_contract  # noqa: E402
from isoexec.gates.compare import compare_bits  # noqa: E402
from isoexec.model import build_model  # noqa: E402
from isoexec.train import PackedSequences, score_logprobs  # noqa: E402

TINY = dict(model_type="qwen3", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, hidden_act="silu",
            max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)


def _model(composition="isoexec", dtype=torch.float32):
    m = build_model("dense", TINY, dtype=dtype).init_random(1)
    m.install(build_contract("dense", composition, "cpu"))
    return m


def test_training_mode_equals_scoring_mode_bitwise():
    m = _model()
    p = PackedSequences.from_lists([[1, 2, 3, 4, 5], [7, 8, 9], list(range(40, 90))])
    a = score_logprobs(m, p, grad=True)
    b = score_logprobs(m, p, grad=False)
    assert a.requires_grad and not b.requires_grad
    assert a.dtype == torch.float32 and a.shape == (4 + 2 + 49,)
    assert compare_bits(a.detach(), b).differing == 0


def test_gradients_flow_to_every_parameter():
    m = _model()
    p = PackedSequences.from_lists([[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7]])
    loss = -score_logprobs(m, p, grad=True).mean()
    loss.backward()
    for name, prm in m.named_parameters():
        assert prm.grad is not None and torch.isfinite(prm.grad).all(), name
        assert prm.grad.abs().sum() > 0, name


def test_gradient_matches_native_at_tolerance():
    iso, nat = _model("isoexec"), _model("native")
    p = PackedSequences.from_lists([[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7, 9, 3, 2]])
    for m in (iso, nat):
        (-score_logprobs(m, p, grad=True).sum()).backward()
    for (n, a), (_, b) in zip(iso.named_parameters(), nat.named_parameters()):
        err = ((a.grad - b.grad).norm() / b.grad.norm()).item()
        assert err < 1e-4, (n, err)


def test_logprobs_are_those_of_the_targets():
    m = _model("native")
    seq = [5, 6, 7, 8]
    lp = score_logprobs(m, PackedSequences.from_lists([seq]))
    from isoexec.model import ForwardBatch

    with torch.no_grad():
        h = m.hidden_states(torch.tensor(seq), ForwardBatch.packed([4], "trainer_score", "cpu"))
        full = torch.log_softmax(m.logits(h, "trainer_score").float(), -1)
    assert torch.allclose(lp, full[torch.arange(3), torch.tensor(seq[1:])])
