"""Every stock (native) region, and the invariant regions an empty pass found wanting, run on a batch
of no token: the FSDP2 trainer's lockstep empty passes (isoexec/dist/fsdp/trainer.py) give every
region of the model a forward, and in training a backward, of no token. A trainer region returns
an empty output of the right shape and dtype and, where its inputs require a gradient, its
backward gives each of them zeros of its own shape (not None: the parameters upstream then get
their zero gradient, which FSDP2 reduce-scatters on every rank). An engine region with no new
token returns an empty output and leaves its state alone.

Before ``isoexec_kernels._empty.no_token``: the stock attention (padded SDPA, and the MLA twin
over it) raised on a batch of no sequence (``torch.cat`` of no index), the stock Gated DeltaNet
chunk form could not reshape its no chunk, the stock conv returned an empty tensor outside the
graph (no conv weight gradient), the invariant two-weight RMSNorm (the fused q/k norm, no graph)
and the Triton RoPE launcher could not reshape a tensor of no token with a -1 (``interp_case_*``
below run the Triton twins under the interpreter). The model-level check is
``tests/train/test_empty_pass_gradients.py``; the CUDA paths run in its ``gpu`` tests."""

from __future__ import annotations

import pytest
import torch

from isoexec_kernels._empty import no_token
from isoexec_kernels.activation.native import silu_and_mul_native
from isoexec_kernels.attention.native import (attention_native_paged_decode, attention_native_paged_prefill,
                                              attention_native_varlen)
from isoexec_kernels.embedding.native import embedding_native
from isoexec_kernels.gated_rmsnorm.native import gated_rms_norm_native
from isoexec_kernels.gdn_conv.native import conv1d_native_decode, conv1d_native_engine, conv1d_native_varlen
from isoexec_kernels.gdn_core import GDNState
from isoexec_kernels.gdn_core.native import (gdn_chunk_engine, gdn_chunk_varlen, gdn_recurrent_decode,
                                             gdn_recurrent_varlen)
from isoexec_kernels.gdn_prep.native import gdn_prep_native
from isoexec_kernels.gemm.native import linear_native
from isoexec_kernels.logprob.native import token_logprobs_native
from isoexec_kernels.mla.native import mla_native_varlen
from isoexec_kernels.moe.native import moe_combine_native, moe_dispatch_native, moe_experts_native, moe_route_native
from isoexec_kernels.moe.types import ROUTER_SIGMOID_GROUP_TOPK, ROUTER_SOFTMAX_TOPK, RouterSpec
from isoexec_kernels.rmsnorm import rms_norm
from isoexec_kernels.rmsnorm.native import rms_norm_native
from isoexec_kernels.rope.native import apply_rope_native
from isoexec_kernels.sigmoid_gate.native import sigmoid_gate_native

# cu_seqlens of a batch of no sequence (an empty pass: ForwardBatch.packed([])) and of sequences of
# no token
NO_TOKEN_CU = {"no_sequence": [0], "empty_sequences": [0, 0, 0]}


def _leaves(*shapes, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _zero_grads_for(out, leaves):
    """Backward of ``out``; every leaf has a zero gradient of its own shape and dtype."""
    assert out.requires_grad, "the output of no token left the graph"
    out.sum().backward()
    for i, t in enumerate(leaves):
        assert t.grad is not None, f"input {i} ({tuple(t.shape)}) got no gradient"
        assert t.grad.shape == t.shape and t.grad.dtype == t.dtype and not t.grad.count_nonzero(), i


def test_no_token_is_empty_and_gives_its_inputs_zero_gradients():
    a, b = _leaves((0, 3), (5, 3))
    out = no_token((0, 7), torch.bfloat16, a, None, b)
    assert out.shape == (0, 7) and out.dtype == torch.bfloat16
    _zero_grads_for(out, [a, b])
    with torch.no_grad():
        assert not no_token((0, 2), torch.float32, a).requires_grad
    with pytest.raises(ValueError, match="empty"):
        no_token((1, 2), torch.float32, a)


@pytest.mark.parametrize("cu", list(NO_TOKEN_CU.values()), ids=list(NO_TOKEN_CU))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stock_attention_and_mla_trainer_of_no_token(cu, dtype):
    cu = torch.tensor(cu, dtype=torch.int32)
    q, k, v = _leaves((0, 4, 16), (0, 2, 16), (0, 2, 16), dtype=dtype)
    out = attention_native_varlen(q, k, v, cu, 0, 0.25)
    assert out.shape == (0, 4, 16) and out.dtype == dtype
    _zero_grads_for(out, [q, k, v])
    q, k, v = _leaves((0, 4, 24), (0, 4, 24), (0, 4, 16), dtype=dtype)   # MLA: value head narrower
    out = mla_native_varlen(q, k, v, cu, 0, 0.2)
    assert out.shape == (0, 4, 16) and out.dtype == dtype
    _zero_grads_for(out, [q, k, v])


def test_stock_paged_attention_of_no_new_token():
    k_cache, v_cache = torch.randn(4, 16, 2, 16), torch.randn(4, 16, 2, 32)
    q = torch.randn(0, 4, 16)
    for table, ctx in ((torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)),
                       (torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32))):
        cu_q = torch.zeros(table.shape[0] + 1, dtype=torch.int32)
        out = attention_native_paged_prefill(q, k_cache, v_cache, table, cu_q, ctx, 0.25)
        assert out.shape == (0, 4, 32)
    out = attention_native_paged_decode(q, k_cache, v_cache, torch.zeros(0, 2, dtype=torch.int32),
                                        torch.zeros(0, dtype=torch.int32), 0.25)
    assert out.shape == (0, 4, 32)


@pytest.mark.parametrize("cu", list(NO_TOKEN_CU.values()), ids=list(NO_TOKEN_CU))
@pytest.mark.parametrize("trainer", [gdn_chunk_varlen, gdn_recurrent_varlen], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16])
def test_stock_gated_deltanet_trainer_of_no_token(trainer, cu, v_dtype):
    q, k, g, beta = _leaves((0, 2, 16), (0, 2, 16), (0, 4), (0, 4))
    (v,) = _leaves((0, 4, 8), dtype=v_dtype)
    out = trainer(q, k, v, g, beta, torch.tensor(cu, dtype=torch.int32), chunk=16)
    assert out.shape == (0, 4, 8) and out.dtype == torch.float32
    _zero_grads_for(out, [q, k, v, g, beta])
    with torch.no_grad():   # scoring: no graph
        out = trainer(q, k, v, g, beta, torch.tensor(cu, dtype=torch.int32), chunk=16)
    assert out.shape == (0, 4, 8) and not out.requires_grad


def test_stock_gated_deltanet_engine_of_no_new_token_leaves_the_state():
    state = GDNState.allocate(3, 4, 16, 8, "cpu", chunk=16)
    state.running.normal_()
    before = state.running.clone()
    q, k, v = torch.randn(0, 2, 16), torch.randn(0, 2, 16), torch.randn(0, 4, 8)
    g, beta = torch.randn(0, 4), torch.randn(0, 4)
    for cu, slots in (([0], []), ([0, 0], [1])):
        out = gdn_chunk_engine(q, k, v, g, beta, torch.tensor(cu, dtype=torch.int32),
                               torch.tensor(slots, dtype=torch.long), state, chunk=16)
        assert out.shape == (0, 4, 8) and out.dtype == torch.float32
    out = gdn_recurrent_decode(q, k, v, g, beta, torch.zeros(0, dtype=torch.long), state, chunk=16)
    assert out.shape == (0, 4, 8)
    assert torch.equal(state.running, before)


@pytest.mark.parametrize("cu", list(NO_TOKEN_CU.values()), ids=list(NO_TOKEN_CU))
def test_stock_conv_of_no_token_keeps_the_weight_in_the_graph(cu):
    x, w = _leaves((0, 6), (6, 4))
    out = conv1d_native_varlen(x, w, torch.tensor(cu, dtype=torch.int32))
    assert out.shape == (0, 6)
    _zero_grads_for(out, [x, w])
    state = torch.randn(2, 6, 3)
    before = state.clone()
    with torch.no_grad():
        assert conv1d_native_engine(x, w, torch.tensor(cu[:1], dtype=torch.int32), torch.zeros(0, dtype=torch.long),
                                    state).shape == (0, 6)
        assert conv1d_native_decode(x, w, torch.zeros(0, dtype=torch.long), state).shape == (0, 6)
    assert torch.equal(state, before)


def test_stock_elementwise_norm_rope_linear_logprob_regions_of_no_token():
    """The stock regions made of torch operations that take empty tensors as they are."""
    x, w, gate = _leaves((0, 3, 8), (8,), (0, 3, 8))
    _zero_grads_for(rms_norm_native(x, w), [x, w])
    _zero_grads_for(gated_rms_norm_native(x, gate, w), [x, gate, w])
    _zero_grads_for(sigmoid_gate_native(x, gate), [x, gate])
    _zero_grads_for(silu_and_mul_native(x, gate), [x, gate])
    _zero_grads_for(apply_rope_native(x, torch.zeros(0, dtype=torch.long), theta=1e4), [x])
    h, wl, table = _leaves((0, 8), (10, 8), (10, 8))
    _zero_grads_for(linear_native(h, wl), [h, wl])
    _zero_grads_for(embedding_native(torch.zeros(0, dtype=torch.long), table), [table])
    (logits,) = _leaves((0, 10))
    lp = token_logprobs_native(logits, torch.zeros(0, dtype=torch.long))
    assert lp.shape == (0,) and lp.dtype == torch.float32
    _zero_grads_for(lp, [logits])
    q, k, a, b, A_log, dt_bias = _leaves((0, 2, 8), (0, 2, 8), (0, 4), (0, 4), (4,), (4,))
    outs = gdn_prep_native(q, k, a, b, A_log, dt_bias)
    assert [o.shape for o in outs] == [(0, 2, 8), (0, 2, 8), (0, 4), (0, 4)]
    _zero_grads_for(sum(o.sum() for o in outs), [q, k, a, A_log, dt_bias])   # b: through sigmoid
    assert b.grad is not None and not b.grad.count_nonzero()


@pytest.mark.parametrize("kind", [ROUTER_SOFTMAX_TOPK, ROUTER_SIGMOID_GROUP_TOPK])
def test_stock_moe_regions_of_no_token(kind):
    E, H, I, top_k = 8, 16, 8, 2
    spec = RouterSpec(kind=kind, top_k=top_k, n_group=2 if kind == ROUTER_SIGMOID_GROUP_TOPK else 1,
                      topk_group=1)
    x, router, gate_up, down, shared = _leaves((0, H), (E, H), (E, 2 * I, H), (E, H, I), (0, H))
    routing = moe_route_native(x, router, spec)
    assert routing.ids.shape == (0, top_k) and routing.weights.shape == (0, top_k)
    disp = moe_dispatch_native(routing.ids, E)
    assert disp.token.numel() == 0 and disp.offsets.tolist() == [0] * (E + 1)
    rows = moe_experts_native(x, disp, gate_up, down)
    out = moe_combine_native(rows, disp, routing, shared, out_dtype=x.dtype)
    assert out.shape == (0, H) and out.dtype == x.dtype
    _zero_grads_for(out, [x, router, gate_up, down, shared])


@pytest.mark.parametrize("grad", [False, True], ids=["score", "train"])
def test_invariant_two_weight_rmsnorm_of_no_token(grad):
    """The fused q/k norm of the isoexec dense model (one call, two weights): without a graph its
    reference path reshaped the k heads with a -1, which a tensor of no token cannot infer."""
    x, w, w2 = _leaves((0, 6, 16), (16,), (16,))
    with torch.set_grad_enabled(grad):
        out = rms_norm(x, w, 1e-6, weight2=w2, heads1=4)
    assert out.shape == (0, 6, 16)
    if grad:
        _zero_grads_for(out, [x, w, w2])


def interp_case_triton_rope_of_no_token(kb):
    """The Triton RoPE launcher (forward and the transposed backward) on a tensor of no token:
    it reshaped x to [T, -1, D], which a tensor of no token cannot infer."""
    from isoexec_kernels.rope.reference import rope_cos_sin
    from isoexec_kernels.rope.triton_kernels import _rope_triton

    cache = rope_cos_sin(torch.arange(4), 16, 1e4)
    for shape in ((0, 4, 16), (0, 16)):
        for transpose in (False, True):
            out = _rope_triton(torch.randn(shape), torch.zeros(0, dtype=torch.long), cache, transpose)
            assert out.shape == shape


def interp_case_triton_two_weight_rmsnorm_of_no_token(kb):
    from isoexec_kernels.rmsnorm.triton_kernels import _triton_fwd

    out, rstd = _triton_fwd(torch.randn(0, 6, 16), torch.ones(16), 1e-6, False, torch.ones(16), 4)
    assert out.shape == (0, 16) and rstd.shape == (0,)


@pytest.mark.parametrize("case", sorted(n for n in list(globals()) if n.startswith("interp_case_")))
def test_no_token_triton_under_interpreter(interp_results, kb, case):
    kb.check_interp(interp_results, "test_no_token_regions", case)
