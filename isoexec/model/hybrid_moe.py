"""The hybrid_moe family of the unified model (Qwen3.5-MoE text architecture, ``qwen3_5_moe_text``).

The hybrid family's layers (``layer_types``: Gated DeltaNet token mixers with CPR, or gated GQA
attention with zero-centred q/k norm and partial rotary; zero-centred RMSNorms), each followed by
a mixture of experts instead of the dense MLP: a softmax router over ``num_experts`` (fp32, top-k
by a stable sort with ties to the lower expert index, the k weights renormalised), the routed
experts' SwiGLU, and one shared expert whose output is scaled by sigmoid(x . w_gate) (the gate is
computed by the router region in fp32). The MoE regions are those of the mla_moe family
(``isoexec/model/mla_moe.py: moe_layer``; ``isoexec_kernels/moe/``). Engine state as the hybrid
family: KV pages for the attention layers, a state slot per sequence for the GDN layers. Expert
parallelism as in mla_moe (``moe_ep``; isoexec/model/ep_moe.py).
"""

from __future__ import annotations

import torch
from torch import nn

from isoexec_kernels.moe import RouterSpec

from ..dist.expert_parallel import ExpertParallelGroup
from ..model_config import HybridMoeConfig
from .hybrid import GatedAttentionLayer, GatedDeltaNetLayer, HybridModel, _params
from .mla_moe import moe_layer, moe_tp_expert_problems, moe_tp_impls


def _moe_params(module: nn.Module, cfg: HybridMoeConfig, dtype, device) -> None:
    """Replace the dense MLP parameters of a hybrid layer by the MoE ones."""
    del module.gate_up_weight, module.down_weight
    h, E, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    _params(module, dtype, device, router_weight=(E, h), experts_gate_up=(E, 2 * inter, h),
            experts_down=(E, h, inter))
    si = cfg.shared_expert_intermediate_size
    if si:
        _params(module, dtype, device, shared_gate_up=(2 * si, h), shared_down=(h, si), shared_gate=(1, h))


class MoeGatedAttentionLayer(GatedAttentionLayer):
    def __init__(self, cfg: HybridMoeConfig, dtype, device):
        super().__init__(cfg, dtype, device)
        _moe_params(self, cfg, dtype, device)


class MoeGatedDeltaNetLayer(GatedDeltaNetLayer):
    def __init__(self, cfg: HybridMoeConfig, dtype, device):
        super().__init__(cfg, dtype, device)
        _moe_params(self, cfg, dtype, device)


class HybridMoeModel(HybridModel):
    """Same public interface as :class:`HybridModel` (recurrent state included)."""

    family = "hybrid_moe"
    #: the expert-parallel group of the MoE layers; None: every expert in this process (ep_moe.py sets it)
    moe_ep: ExpertParallelGroup | None = None

    @staticmethod
    def layer_classes() -> dict:
        return {"full_attention": MoeGatedAttentionLayer, "linear_attention": MoeGatedDeltaNetLayer}

    def __init__(self, cfg: HybridMoeConfig, dtype=torch.float32, device="cpu"):
        super().__init__(cfg, dtype, device)
        self.router_spec = RouterSpec(kind="softmax_topk", top_k=cfg.num_experts_per_tok, norm_topk_prob=True)

    # ------------------------------------------------------------------------------ tensor parallelism
    _DENSE_MLP = ("gate_proj", "up_proj", "down_proj")

    def linear_k(self) -> dict[str, int]:
        """The hybrid model's linear ops less the dense MLP's, with the shared expert's."""
        h = self.cfg.hidden_size
        return {**{o: k for o, k in super().linear_k().items() if o not in self._DENSE_MLP},
                "shared_gate_proj": h, "shared_up_proj": h,
                "shared_down_proj": self.cfg.shared_expert_intermediate_size}

    def tp_head_problems(self, tp: int) -> list[str]:
        """The hybrid model's heads and whole routed experts per rank."""
        return super().tp_head_problems(tp) + moe_tp_expert_problems(self.cfg.num_experts, tp)

    def tp_row_parallel(self) -> dict[str, tuple[int, int | None]]:
        """o_proj and the Gated DeltaNet out_proj (no dense MLP, so no down_proj)."""
        return {o: v for o, v in super().tp_row_parallel().items() if o != "down_proj"}

    def tp_impls(self) -> dict[str, tuple[str | tuple[str, ...], str | None]]:
        """The hybrid model's kernels and the MoE regions (mla_moe.moe_tp_impls)."""
        return {**super().tp_impls(), **moe_tp_impls()}

    def _mlp(self, plan, L, n: torch.Tensor) -> torch.Tensor:
        """The layer's MoE block (router, experts, gated shared expert) on its normed input."""
        return moe_layer(plan, L, n, self.router_spec, self.cfg.num_experts, self.cfg.shared_expert_intermediate_size,
                         self.moe_ep)
