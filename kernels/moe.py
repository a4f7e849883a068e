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
  ``moe_forward(x, weights, *, kind, top_k, ...)``   dispatcher; today every device runs the
                                                     reference (the Triton twin is a later step)
  ``moe_forward_reference(x, weights, *, kind, top_k, ...)``  the torch twin
  building blocks, each usable alone (a Triton grouped GEMM replaces :func:`experts_forward`
  and keeps the rest):
  ``router_logits(x, router_weight)``  fp32 [T, E]
  ``route(logits, spec, correction_bias=None)`` -> ``Routing(ids, weights)``, ids [T, k] int64
                                       ascending per token, weights fp32 [T, k] in that order
  ``dispatch(ids, num_experts)`` -> ``Dispatch`` (expert-major, token-ascending rows)
  ``experts_forward(x, disp, gate_up, down)`` -> expert output rows [T*k, H] in dispatch order
  ``shared_expert_forward(x, gate_up, down, gate=None)`` -> (rows [T, H], fp32 gate [T, 1] | None)
  ``combine(expert_rows, disp, routing, shared=None, shared_gate=None)`` -> [T, H]
  ``MoEWeights``, ``RouterSpec``, ``ROUTER_KINDS``, ``IMPL_REFERENCE``
Weight layouts are transformers' (stacked 3-D expert parameters): ``gate_up [E, 2I, H]`` (the
gate's I rows, then the up projection's I rows), ``down [E, H, I]``, router ``[E, H]``.

Rounding schedule (per token t; x in bf16/fp16/fp32; "lin" is the invariant GEMM of
``gemm.py``: fp32 products, fixed 64-wide K blocks summed by a fixed tree and accumulated in K
order, one rounding to its input dtype)
  1. logits z = lin(fp32(x_t), fp32(router)): fp32 [E] (fp32 inputs, so no rounding of the
     logits to the model dtype; transformers' Qwen router rounds them to it).
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
  3. dispatch: the (token, slot) pairs sorted by the unique key expert * T + token, i.e.
     expert-major, token-ascending; expert e owns rows ``offsets[e]:offsets[e+1]`` (integer
     arithmetic only: no rounding).
  4. experts (SwiGLU), for each expert on its rows: h = lin(x_rows, gate_up[e]) rounded to x's
     dtype; a = silu_and_mul(h) (``activation.py``: silu(gate) * up in fp32, position-free
     float64 exp, one rounding to x's dtype); y = lin(a, down[e]) rounded to x's dtype.
     Invariance: lin's schedule makes every output element a fixed function of its own input row
     and the weight (no split-K, no tile or blocking keyed on the row count), and silu_and_mul is
     elementwise. So a token's expert output is the same whether the expert received 1 row or
     all T*k of them, and wherever the row lands in the expert's range. A grouped GEMM that
     replaces this loop must keep that property (one K order per row whatever its tile holds).
  5. shared expert (if any): ys = lin(silu_and_mul(lin(x, shared_gate_up)), shared_down) in x's
     dtype, the same schedule as a routed expert; with a Qwen-style gate,
     g = fp32(sigmoid(lin(fp32(x), fp32(shared_gate)))) (float64 exp, one fp32 rounding).
  6. combine, in fp32 from +0, in this fixed order:
         acc = +0
         for the k chosen experts in ascending expert index:  acc = acc + fp32(w_j * fp32(y_j))
         then the shared expert:                                acc = acc + fp32(g * fp32(ys))
                                                                (acc + fp32(ys) without a gate)
         out_t = round_to_x_dtype(acc)
     Every product is rounded to fp32 before its add (no fused multiply-add), and the output is
     rounded once. transformers instead rounds each weighted expert row to the model dtype and
     adds it to a model-dtype buffer (``index_add_``), then adds the shared expert in that dtype.

Autograd: the reference is made of torch ops, so autograd can run through the expert GEMMs,
the activation and the weights (the selection itself has no gradient), but that backward is
neither designed nor gated yet: a later step adds the deterministic backward. Use this module for
forward computations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _ref
from .activation import silu_and_mul_reference
from .gemm import linear_reference

__all__ = [
    "ROUTER_SOFTMAX_TOPK",
    "ROUTER_SIGMOID_GROUP_TOPK",
    "ROUTER_KINDS",
    "IMPL_REFERENCE",
    "MoEWeights",
    "RouterSpec",
    "Routing",
    "Dispatch",
    "router_logits",
    "route",
    "dispatch",
    "experts_forward",
    "shared_expert_forward",
    "combine",
    "moe_forward",
    "moe_forward_reference",
]

ROUTER_SOFTMAX_TOPK = "softmax_topk"
ROUTER_SIGMOID_GROUP_TOPK = "sigmoid_group_topk"
ROUTER_KINDS = (ROUTER_SOFTMAX_TOPK, ROUTER_SIGMOID_GROUP_TOPK)
IMPL_REFERENCE = "ref_moe"

_NORM_EPS_SIGMOID = 1e-20  # transformers' DeepSeek-V3 / GLM-4 denominator guard


@dataclass(frozen=True)
class RouterSpec:
    """How tokens pick experts. ``kind`` is one of :data:`ROUTER_KINDS`; ``n_group``,
    ``topk_group``, ``routed_scaling_factor`` apply to ``sigmoid_group_topk`` only."""

    kind: str
    top_k: int
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def check(self, num_experts: int) -> None:
        if self.kind not in ROUTER_KINDS:
            raise ValueError(f"moe: unknown router kind {self.kind!r} (expected one of {ROUTER_KINDS})")
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"moe: top_k={self.top_k} must be in [1, {num_experts}]")
        if self.kind == ROUTER_SIGMOID_GROUP_TOPK:
            if self.n_group < 1 or num_experts % self.n_group:
                raise ValueError(f"moe: {num_experts} experts do not split into n_group={self.n_group}")
            size = num_experts // self.n_group
            if size < 2:
                raise ValueError(f"moe: groups of {size} expert(s); a group score needs 2")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"moe: topk_group={self.topk_group} must be in [1, {self.n_group}]")
            if self.top_k > self.topk_group * size:
                raise ValueError(f"moe: top_k={self.top_k} exceeds the {self.topk_group * size} "
                                 "experts of the kept groups")


@dataclass
class MoEWeights:
    """Parameters of one MoE layer (transformers' layouts).

    router [E, H]; gate_up [E, 2I, H] (gate rows then up rows); down [E, H, I];
    correction_bias [E] (fp32, ``sigmoid_group_topk`` selection only; None = zeros);
    shared_gate_up [2Is, H] and shared_down [H, Is] (None = no shared expert; several shared
    experts are one wider shared expert, as transformers builds them); shared_gate [1, H]
    (Qwen-style sigmoid gate of the shared expert; None = ungated)."""

    router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    correction_bias: torch.Tensor | None = None
    shared_gate_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]

    def check(self, hidden: int) -> None:
        E = self.router.shape[0]
        if self.router.shape != (E, hidden):
            raise ValueError(f"moe: router must be [E, H={hidden}], got {tuple(self.router.shape)}")
        if self.gate_up.dim() != 3 or self.gate_up.shape[0] != E or self.gate_up.shape[2] != hidden \
                or self.gate_up.shape[1] % 2:
            raise ValueError(f"moe: gate_up must be [E={E}, 2I, H={hidden}], got {tuple(self.gate_up.shape)}")
        inter = self.gate_up.shape[1] // 2
        if self.down.shape != (E, hidden, inter):
            raise ValueError(f"moe: down must be [E={E}, H={hidden}, I={inter}], got {tuple(self.down.shape)}")
        if self.correction_bias is not None and self.correction_bias.shape != (E,):
            raise ValueError(f"moe: correction_bias must be [E={E}], got {tuple(self.correction_bias.shape)}")
        if (self.shared_gate_up is None) != (self.shared_down is None):
            raise ValueError("moe: shared_gate_up and shared_down come together")
        if self.shared_gate is not None and self.shared_gate_up is None:
            raise ValueError("moe: shared_gate without a shared expert")
        if self.shared_gate_up is not None:
            s2 = self.shared_gate_up.shape
            if len(s2) != 2 or s2[1] != hidden or s2[0] % 2 \
                    or self.shared_down.shape != (hidden, s2[0] // 2):
                raise ValueError(f"moe: shared expert must be gate_up [2Is, H={hidden}] and down [H, Is], "
                                 f"got {tuple(s2)} and {tuple(self.shared_down.shape)}")
        if self.shared_gate is not None and self.shared_gate.shape != (1, hidden):
            raise ValueError(f"moe: shared_gate must be [1, H={hidden}], got {tuple(self.shared_gate.shape)}")


@dataclass
class Routing:
    """ids [T, k] int64, ascending per token; weights [T, k] fp32 in the same order."""

    ids: torch.Tensor
    weights: torch.Tensor


@dataclass
class Dispatch:
    """The T*k (token, slot) pairs in expert-major, token-ascending order.

    token [T*k]: the token of each dispatched row; offsets [E+1]: expert e owns rows
    ``offsets[e]:offsets[e+1]``; row_of_pair [T*k]: the dispatched row of pair t*k + j
    (its inverse permutation). Integers only."""

    token: torch.Tensor
    offsets: torch.Tensor
    row_of_pair: torch.Tensor
    num_tokens: int
    top_k: int

    @property
    def counts(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]


# ---------------------------------------------------------------------------------------------
# Router
# ---------------------------------------------------------------------------------------------


def router_logits(x: torch.Tensor, router_weight: torch.Tensor, linear=linear_reference) -> torch.Tensor:
    """fp32 [T, E] logits = lin(fp32(x), fp32(router_weight)); x [T, H]. A row's logits are a
    function of that row only (the GEMM's schedule)."""
    return linear(x.float(), router_weight.float())


def _sigmoid_fp32(z: torch.Tensor) -> torch.Tensor:
    """fp32(1 / (1 + exp(-z))) from float64 basic operations (position-free)."""
    return (1.0 / (1.0 + _ref.exp64(-z.double()))).float()


def _desc_order(v: torch.Tensor) -> torch.Tensor:
    """Indices of the last dim sorted by value descending, equal values by ascending index."""
    return torch.sort(v, dim=-1, descending=True, stable=True).indices


def _sum_left_to_right(w: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim, ((+0 + w_0) + w_1) + ..., fp32."""
    acc = torch.zeros(w.shape[:-1], dtype=torch.float32, device=w.device)
    for j in range(w.shape[-1]):
        acc = acc + w[..., j]
    return acc


def _softmax_fp32(z: torch.Tensor) -> torch.Tensor:
    m = z.max(dim=-1, keepdim=True).values + 0.0
    e = _ref.exp64((z - m).double()).float()
    s = _ref.tree_sum0(e.t().contiguous())  # halves tree over the experts: a function of E only
    return e / s[:, None]


def route(logits: torch.Tensor, spec: RouterSpec, correction_bias: torch.Tensor | None = None) -> Routing:
    """Expert choice and weights of each row of fp32 ``logits [T, E]`` (module docstring, step 2).
    Every row is handled on its own: nothing here reduces across rows."""
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise ValueError(f"moe.route: logits must be fp32 [T, E], got {logits.dtype} {tuple(logits.shape)}")
    T, E = logits.shape
    spec.check(E)
    k = spec.top_k
    if spec.kind == ROUTER_SOFTMAX_TOPK:
        if correction_bias is not None:
            raise ValueError("moe.route: the softmax_topk router takes no correction bias")
        p = _softmax_fp32(logits)
        chosen = _desc_order(p)[:, :k]
        ids = torch.sort(chosen, dim=-1).values
        w = p.gather(1, ids)
        if spec.norm_topk_prob:
            w = w / _sum_left_to_right(w)[:, None]
        return Routing(ids=ids, weights=w)

    s = _sigmoid_fp32(logits)
    b = s if correction_bias is None else s + correction_bias.float()
    size = E // spec.n_group
    bg = b.view(T, spec.n_group, size)
    top2 = bg.gather(2, _desc_order(bg)[:, :, :2])
    group_score = top2[:, :, 0] + top2[:, :, 1]
    kept = _desc_order(group_score)[:, :spec.topk_group]
    keep = torch.zeros(T, spec.n_group, dtype=torch.bool, device=logits.device)
    keep.scatter_(1, kept, True)
    keep = keep[:, :, None].expand(T, spec.n_group, size).reshape(T, E)
    b = b.masked_fill(~keep, float("-inf"))
    chosen = _desc_order(b)[:, :k]
    ids = torch.sort(chosen, dim=-1).values
    w = s.gather(1, ids)
    if spec.norm_topk_prob:
        w = w / (_sum_left_to_right(w) + _NORM_EPS_SIGMOID)[:, None]
    w = w * float(spec.routed_scaling_factor)
    return Routing(ids=ids, weights=w)


# ---------------------------------------------------------------------------------------------
# Dispatch, experts, combine
# ---------------------------------------------------------------------------------------------


def dispatch(ids: torch.Tensor, num_experts: int) -> Dispatch:
    """Sort the (token, slot) pairs of ``ids [T, k]`` expert-major, token-ascending. The sort key
    expert * T + token is unique, so the order does not depend on the sort algorithm."""
    T, k = ids.shape
    flat = ids.reshape(-1).long()
    tok = torch.arange(T, device=ids.device).repeat_interleave(k)
    order = torch.argsort(flat * T + tok)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=ids.device)
    offsets[1:] = torch.cumsum(counts, 0)
    row_of_pair = torch.empty_like(order)
    row_of_pair[order] = torch.arange(order.numel(), device=ids.device)
    return Dispatch(token=tok[order], offsets=offsets, row_of_pair=row_of_pair, num_tokens=T, top_k=k)


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, linear, act) -> torch.Tensor:
    return linear(act(linear(x, gate_up)), down)


def experts_forward(x: torch.Tensor, disp: Dispatch, gate_up: torch.Tensor, down: torch.Tensor,
                    linear=linear_reference, act=silu_and_mul_reference) -> torch.Tensor:
    """Expert output rows [T*k, H] in dispatch order (x's dtype): each expert's SwiGLU on the rows
    it owns (module docstring, step 4). Experts with no rows are skipped."""
    out = torch.empty((disp.token.numel(), x.shape[-1]), dtype=x.dtype, device=x.device)
    offs = disp.offsets.tolist()
    for e in range(len(offs) - 1):
        r0, r1 = offs[e], offs[e + 1]
        if r1 > r0:
            out[r0:r1] = _swiglu(x[disp.token[r0:r1]], gate_up[e], down[e], linear, act)
    return out


def shared_expert_forward(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                          gate: torch.Tensor | None = None, linear=linear_reference,
                          act=silu_and_mul_reference):
    """(shared expert rows [T, H] in x's dtype, fp32 sigmoid gate [T, 1] or None)."""
    ys = _swiglu(x, gate_up, down, linear, act)
    g = None if gate is None else _sigmoid_fp32(linear(x.float(), gate.float()))
    return ys, g


def combine(expert_rows: torch.Tensor, disp: Dispatch, routing: Routing,
            shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Each token's k weighted expert rows summed in fp32 in ascending expert index from +0, then
    the (gated) shared expert, one rounding (module docstring, step 6)."""
    T, k = disp.num_tokens, disp.top_k
    H = expert_rows.shape[-1]
    y = expert_rows[disp.row_of_pair].view(T, k, H)  # slot order = ascending expert index
    acc = torch.zeros((T, H), dtype=torch.float32, device=expert_rows.device)
    w = routing.weights
    for j in range(k):
        acc = acc + w[:, j:j + 1] * y[:, j].float()
    if shared is not None:
        acc = acc + (shared.float() if shared_gate is None else shared_gate * shared.float())
    return acc.to(out_dtype or expert_rows.dtype)


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------


def _spec(kind, top_k, norm_topk_prob, n_group, topk_group, routed_scaling_factor) -> RouterSpec:
    return RouterSpec(kind=kind, top_k=top_k, norm_topk_prob=norm_topk_prob, n_group=n_group,
                      topk_group=topk_group, routed_scaling_factor=routed_scaling_factor)


def _forward(x, weights: MoEWeights, spec: RouterSpec, linear, act):
    H = x.shape[-1]
    weights.check(H)
    spec.check(weights.num_experts)
    x2 = x.reshape(-1, H)
    routing = route(router_logits(x2, weights.router, linear), spec, weights.correction_bias)
    disp = dispatch(routing.ids, weights.num_experts)
    rows = experts_forward(x2, disp, weights.gate_up.to(x.dtype), weights.down.to(x.dtype), linear, act)
    shared = gate = None
    if weights.shared_gate_up is not None:
        shared, gate = shared_expert_forward(x2, weights.shared_gate_up.to(x.dtype),
                                             weights.shared_down.to(x.dtype), weights.shared_gate,
                                             linear, act)
    return combine(rows, disp, routing, shared, gate, x.dtype).reshape(x.shape)


def moe_forward_reference(x: torch.Tensor, weights: MoEWeights, *, kind: str, top_k: int,
                          norm_topk_prob: bool = True, n_group: int = 1, topk_group: int = 1,
                          routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """MoE layer output [..., H] in x's dtype for ``x [..., H]`` by the reference schedule (module
    docstring). Expert weights are used in x's dtype; router and shared gate in fp32."""
    spec = _spec(kind, top_k, norm_topk_prob, n_group, topk_group, routed_scaling_factor)
    return _forward(x, weights, spec, linear_reference, silu_and_mul_reference)


def moe_forward(x: torch.Tensor, weights: MoEWeights, *, kind: str, top_k: int,
                norm_topk_prob: bool = True, n_group: int = 1, topk_group: int = 1,
                routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """Batch-invariant MoE layer (module docstring). Until the Triton twin exists, every device
    runs :func:`moe_forward_reference`."""
    return moe_forward_reference(x, weights, kind=kind, top_k=top_k, norm_topk_prob=norm_topk_prob,
                                 n_group=n_group, topk_group=topk_group,
                                 routed_scaling_factor=routed_scaling_factor)
