"""The mixture-of-experts layer's data: router kinds, weights (transformers' layouts), the routing of
the tokens and their dispatch to the experts."""

from __future__ import annotations

from dataclasses import dataclass

import torch


ROUTER_SOFTMAX_TOPK = "softmax_topk"
ROUTER_SIGMOID_GROUP_TOPK = "sigmoid_group_topk"
ROUTER_KINDS = (ROUTER_SOFTMAX_TOPK, ROUTER_SIGMOID_GROUP_TOPK)


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
    """ids [T, k] int64, ascending per token; weights [T, k] fp32 in the same order (the stock
    twin: transformers' top-k order and dtype). ``shared_gate``: the shared expert's gate [T, 1]
    when the layer has a gated shared expert (Qwen), computed by the router region."""

    ids: torch.Tensor
    weights: torch.Tensor
    shared_gate: torch.Tensor | None = None


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
