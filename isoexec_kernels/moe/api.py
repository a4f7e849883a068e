"""Batch-invariant mixture-of-experts layer (router, dispatch, experts, combine): torch reference.

A token's output is a function of that token's hidden row and the weights only: not of how many
tokens share the batch, which experts they picked, how many rows each expert received, or where
the token sits in the batch. Two router kinds cover the MoE families of the project:

  ``"softmax_topk"``        transformers ``qwen3_moe`` / ``qwen3_5_moe_text``: softmax over the
                            experts, top-k, optional renormalisation of the k weights
                            (``norm_topk_prob``); Qwen3.5 adds a shared expert with a sigmoid gate.
  ``"sigmoid_group_topk"``  transformers ``deepseek_v3`` / ``glm4_moe`` (``glm4_moe_lite``):
                            sigmoid scores, a correction bias used for selection only,
                            group-limited selection, top-k inside the kept groups, weights = the
                            unbiased scores of the chosen experts (normalised if
                            ``norm_topk_prob``) times ``routed_scaling_factor``; ungated shared
                            experts.

Public API
  ``moe_forward(x, weights, *, kind, top_k, ...)``   dispatcher: on CUDA (Triton installed) the
                                                     public invariant ``linear`` / ``silu_and_mul``
                                                     (Triton) and the grouped-GEMM experts; on any
                                                     other device the reference
  ``moe_forward_reference(x, weights, *, kind, top_k, ...)``  the torch twin
  ``experts_forward_triton(x, disp, gate_up, down)``  Triton twin of :func:`experts_forward`
                                       (``triton_kernels.py``: grouped GEMM, silu_and_mul,
                                       grouped GEMM; three launches, no host sync)
  ``grouped_linear(x, w, offsets, idx=None, ...)``  the grouped GEMM alone
  building blocks, each usable alone (the Triton grouped GEMM replaces :func:`experts_forward`
  on CUDA and keeps the rest):
  ``router_logits(x, router_weight)``  fp32 [T, E]
  ``route(logits, spec, correction_bias=None)`` -> ``Routing(ids, weights)``, ids [T, k] int64
                                       ascending per token, weights fp32 [T, k] in that order
  ``dispatch(ids, num_experts)`` -> ``Dispatch`` (expert-major, token-ascending rows)
  ``experts_forward(x, disp, gate_up, down)`` -> expert output rows [T*k, H] in dispatch order
  ``shared_expert_forward(x, gate_up, down, gate=None)`` -> (rows [T, H], fp32 gate [T, 1] | None)
  ``combine(expert_rows, disp, routing, shared=None, shared_gate=None)`` -> [T, H]
  ``MoEWeights``, ``RouterSpec``, ``ROUTER_KINDS``
Weight layouts are transformers' (stacked 3-D expert parameters): ``gate_up [E, 2I, H]`` (the
gate's I rows, then the up projection's I rows), ``down [E, H, I]``, router ``[E, H]``.

Rounding schedule (per token t; x in bf16/fp16/fp32; "lin" is the invariant GEMM of
``gemm.py``: fp32 products, fixed 64-wide K blocks summed by a fixed tree and accumulated in K
order, one rounding to its input dtype)
  1. logits z = lin(x_t, router) with fp32 output: fp32 [E], the exact products of the model
     dtype's values accumulated in fp32 and never rounded to the model dtype (transformers' Qwen
     router rounds them to it). On the reference this is lin(fp32(x_t), fp32(router)) bit for bit;
     on the GPU it is the 16-bit GEMM (tensor cores, the same fixed K loop) with its fp32
     accumulator stored as it is (``reference.fp32_linear``; an fp32 router weight in a 16-bit
     model: both cast to fp32).
  2. router
     * softmax_topk: m = max_j z_j (exact, -0 -> +0); e_j = fp32(exp(z_j - m)) with z_j - m
       rounded in fp32 and exp evaluated in float64 from basic operations (``_ref.exp64``);
       S = sum_j e_j by the halves tree over the E experts (``_ref.tree_sum0``, zero-padded to a
       power of two: a function of E only); p_j = e_j / S (fp32). Selection: the k largest p_j,
       ties to the lower expert index. Weights w_j = p_j, or with ``norm_topk_prob``
       w_j = p_j / D, D = the k chosen p_j summed left to right from +0 in ascending expert index.
     * sigmoid_group_topk: s_j = fp32(1 / (1 + exp(-z_j))) (float64 from basic operations);
       b_j = s_j + bias_j (fp32, selection only). The E experts form ``n_group`` contiguous
       groups; a group's score is its largest b plus its second largest b (one fp32 add; a
       two-term sum has no order). The ``topk_group`` best groups are kept (ties: lower group
       index); the k largest b_j inside the kept groups are chosen (ties: lower expert index).
       Weights w_j = s_j, or with ``norm_topk_prob`` w_j = s_j / (D + 1e-20), D = the chosen s_j
       summed left to right from +0 in ascending expert index; then w_j = w_j * fp32(rsf)
       (``routed_scaling_factor``), all fp32.
     Selection uses a stable descending sort (``torch.sort(stable=True)``) and keeps the first
     k: among equal values the lower index comes first. ``torch.topk`` is not used: its order
     among equal values is unspecified and changes with the input size and device (on this
     project's CPU, ``torch.topk(zeros(8), 4)`` returned experts [6, 5, 4, 7] and for 256
     experts [1, 3, 0, 2]), so the expert kept on a tie would not be a documented function of
     the row. The k chosen experts are then listed in ascending expert index (``Routing.ids``).
     On CUDA (the model's ``router`` region) steps 2 and the shared gate's sigmoid run as one
     Triton launch with the device's fp32 exp and tree sums (``router_triton.py``, its own
     schedule: the same selection rules, other bits; no float64 on the GPU).
  3. dispatch: the (token, slot) pairs sorted by the unique key expert * T + token, i.e.
     expert-major, token-ascending; expert e owns rows ``offsets[e]:offsets[e+1]`` (integer
     arithmetic only: no rounding).
  4. experts (SwiGLU), for each expert on its rows: h = lin(x_rows, gate_up[e]) rounded to x's
     dtype; a = silu_and_mul(h) (``activation.py``: silu(gate) * up in fp32, position-free
     float64 exp, one rounding to x's dtype); y = lin(a, down[e]) rounded to x's dtype.
     Invariance: lin's schedule makes every output element a fixed function of its own input row
     and the weight (no split-K, no tile or blocking keyed on the row count), and silu_and_mul is
     elementwise. So a token's expert output is the same whether the expert received 1 row or
     all T*k of them, and wherever the row lands in the expert's range.
     * reference (CPU): a Python loop over the experts, ``lin`` on each expert's gathered rows.
     * Triton (CUDA): ``triton_kernels.grouped_linear``, ONE launch for all experts' rows
       (programs over (expert, m-tile, n-tile), found on the device from ``offsets``; rows
       gathered by token inside the kernel) with lin's K loop: 64-wide K blocks, one ``tl.dot``
       each, accumulated in K order into fp32 from +0, one rounding. So a row's bits should be
       those of the Triton ``lin`` for that row alone (on the H200 lin's tiles never changed the
       bits); the GPU tests of ``tests/kernels/test_moe_grouped_gemm.py`` check that the grouped
       path equals the loop on the Triton ``lin`` bitwise, and that a token's rows do not change
       with its experts' loads (not yet run on a GPU). Both differ from the CPU reference
       (different kernels, as for ``lin``).
  5. shared expert (if any): ys = lin(silu_and_mul(lin(x, shared_gate_up)), shared_down) in x's
     dtype, the same schedule as a routed expert; with a Qwen-style gate,
     g = fp32(sigmoid(fp32_linear(x, shared_gate))) (float64 exp, one fp32 rounding).
  6. combine, in fp32 from +0, in this fixed order:
         acc = +0
         for the k chosen experts in ascending expert index:  acc = acc + fp32(w_j * fp32(y_j))
         then the shared expert:                                acc = acc + fp32(g * fp32(ys))
                                                                (acc + fp32(ys) without a gate)
         out_t = round_to_x_dtype(acc)
     Every product is rounded to fp32 before its add (no fused multiply-add), and the output is
     rounded once. On CUDA the ``combine`` region runs these operations as one Triton launch
     (``combine_triton.py``, compiled without contraction: the same bits). transformers instead rounds each weighted expert row to the model dtype and
     adds it to a model-dtype buffer (``index_add_``), then adds the shared expert in that dtype.

Autograd: the reference is made of torch ops, so autograd runs through the expert GEMMs, the
activation and the routing weights (the selection itself has no gradient). The regions the model
binds (``regions.py``) use the public ``linear`` and ``silu_and_mul``, whose designed backwards run
there; on CPU the mla_moe and hybrid_moe ``backward_determinism`` gates check the result is
deterministic. On CUDA the experts' backward is ``triton_kernels._GroupedLinearFn``: input
gradients by the grouped kernel on the transposed weights (a token's k rows summed in fp32 over a
fixed [T, k] layout, no atomics), weight gradients by a per-(expert, tile) kernel that walks the
expert's rows in order: deterministic, not batch invariant, no float64.
"""

from __future__ import annotations

import torch

from .._triton_util import want_triton
from .reference import _forward, _spec, moe_forward_reference
from .triton_kernels import experts_forward_triton
from .types import MoEWeights


def moe_forward(x: torch.Tensor, weights: MoEWeights, *, kind: str, top_k: int,
                norm_topk_prob: bool = True, n_group: int = 1, topk_group: int = 1,
                routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """Batch-invariant MoE layer (module docstring): on CUDA the invariant ``linear`` and
    ``silu_and_mul`` (Triton) with the grouped-GEMM experts, elsewhere
    :func:`moe_forward_reference`."""
    if want_triton(x):
        from ..activation import silu_and_mul
        from ..gemm import linear

        spec = _spec(kind, top_k, norm_topk_prob, n_group, topk_group, routed_scaling_factor)
        return _forward(x, weights, spec, linear, silu_and_mul, experts_forward_triton)
    return moe_forward_reference(x, weights, kind=kind, top_k=top_k, norm_topk_prob=norm_topk_prob,
                                 n_group=n_group, topk_group=topk_group,
                                 routed_scaling_factor=routed_scaling_factor)
