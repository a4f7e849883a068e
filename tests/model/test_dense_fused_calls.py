"""The dense layer's fused calls (the residual add in the o_proj / down_proj GEMM's epilogue; the q
and k norms in one launch and one RoPE launch over both) give the bits of the separate calls."""

from __future__ import annotations

import pytest
import torch

from isoexec.bits import count_differing
from isoexec.compose import build_contract
from isoexec.model import ForwardBatch, build_model
from isoexec.model import dense as dense_module

TINY = dict(model_type="qwen3", vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
            max_position_embeddings=512, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True)
# a GPU size: head_dim 128 as Qwen3 (the Triton kernels' tiles)
SMALL = dict(TINY, vocab_size=1024, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
             num_key_value_heads=4, head_dim=128)


def _assert_bitwise(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, what
    differing = count_differing(a, b)
    assert differing == 0, f"{what}: {differing} of {a.numel()} elements differ"


def _model(cfg, composition, arch, dtype, device):
    m = build_model("dense", cfg, dtype=dtype, device=device).init_random(seed=5)
    m.install(build_contract("dense", composition, arch))
    return m


def _unfused(monkeypatch):
    monkeypatch.setattr(dense_module, "_qk_norms_in_one_call", lambda plan: False)
    monkeypatch.setattr(dense_module, "_takes", lambda fn, parameter: False)


def _hidden(m, ids, lens, device):
    return m.hidden_states(ids, ForwardBatch.packed(lens, "trainer_score", device))


def _forward_and_grads(m, ids, lens, device):
    """(trainer_score hidden states, trainer_fwd hidden states, every parameter's gradient)."""
    with torch.no_grad():
        scored = _hidden(m, ids, lens, device)
    m.zero_grad(set_to_none=True)
    graded = m.hidden_states(ids, ForwardBatch.packed(lens, "trainer_fwd", device))
    graded.float().square().sum().backward()
    return scored, graded.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _check(monkeypatch, cfg, arch, dtype, device):
    m = _model(cfg, "isoexec", arch, dtype, device)
    plan = m._plan("trainer_score")
    assert dense_module._qk_norms_in_one_call(plan), "the q/k norms would not run as one call"
    assert dense_module._takes(plan["o_proj"].fn, "residual") and dense_module._takes(plan["down_proj"].fn, "residual")
    lens = [23, 9, 31]
    ids = torch.randint(0, cfg["vocab_size"], (sum(lens),), generator=torch.Generator().manual_seed(1)).to(device)
    scored, graded, grads = _forward_and_grads(m, ids, lens, device)
    _assert_bitwise(graded, scored, "trainer_fwd vs trainer_score")
    _unfused(monkeypatch)
    scored_u, graded_u, grads_u = _forward_and_grads(m, ids, lens, device)
    _assert_bitwise(scored, scored_u, "fused vs separate calls, no autograd")
    _assert_bitwise(graded, graded_u, "fused vs separate calls, autograd")
    # the backward need not be the separate calls' bits (the q/k norm weights' gradients sum
    # other row ranges on the GPU), only their values
    assert grads.keys() == grads_u.keys() and len(grads) == len(list(m.parameters()))
    for name, g in grads.items():
        torch.testing.assert_close(g.float(), grads_u[name].float(), rtol=2e-2, atol=1e-3, msg=name)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_dense_fused_calls_equal_the_separate_calls_bitwise(monkeypatch, dtype):
    _check(monkeypatch, TINY, "cpu", dtype, "cpu")


def test_native_composition_keeps_its_separate_calls():
    # the stock norm takes one weight and the stock linear no residual: native's bits stay those
    # of its separate calls (its tensor-parallel model at tp 1 is the one-process model)
    plan = _model(TINY, "native", "cpu", torch.float32, "cpu")._plan("trainer_score")
    with torch.no_grad():
        assert not dense_module._qk_norms_in_one_call(plan)
    assert not dense_module._takes(plan["o_proj"].fn, "residual")


@pytest.mark.gpu
def test_dense_fused_calls_equal_the_separate_calls_bitwise_cuda(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _check(monkeypatch, SMALL, "sm90", torch.bfloat16, "cuda")
