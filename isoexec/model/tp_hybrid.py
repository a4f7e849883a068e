"""The hybrid model (Qwen3.5: Gated DeltaNet and gated attention layers) under tensor parallelism,
with the bits of one process.

``TensorParallelHybrid(model, group)`` takes a single-process ``HybridModel`` with its contract
installed and keeps, on this rank of the tensor-parallel ``group``, the shards of its weights. It
extends ``TensorParallelDense`` (tp_dense.py) as ``HybridModel`` extends ``DenseModel``: the size
checks, the vocabulary-parallel lm_head and logprob, the engine's whole logits rows, the
column-parallel helper, the MLP and ``shard_weights`` are the dense model's; the layers are its own.

Gated attention layers (``full_attention``):
  * q (with its output gate: transformers keeps each query head's rows as [query | gate]), k and v
    column-parallel by whole heads: this rank's ``num_heads / tp`` query heads with their gate rows,
    and ``num_kv_heads / tp`` kv heads (GQA groups stay whole, both cuts are contiguous);
  * the zero-centred q/k norms, the partial rotary, attention and the sigmoid gate on the rank's
    heads: per-head (per-row, per-element) arithmetic, as in the dense model;
  * o_proj row-parallel, summed as its contract entry says (``TensorParallelDense._row_parallel``:
    with the contract's ``K_LEAVES`` the fixed leaf order, without it the stock all-reduce); its
    input columns are the rank's heads, which ``tp_problems`` checks fall on whole K leaves.

Gated DeltaNet layers (``linear_attention``): rank r holds the key heads
``[r * Hk / tp, (r + 1) * Hk / tp)`` and the value heads of those key heads,
``[r * Hv / tp, (r + 1) * Hv / tp)`` (value head h reads key head ``h // (Hv / Hk)``, so a key head's
group of value heads stays on one rank, and the rank's value head j reads its key head
``j // (Hv / Hk)`` as in one process):
  * the in-projection (``gdn_in_proj`` = q, k, v, z and ``gdn_ba_proj`` = b, a, fused or not as the
    contract says) column-parallel: the rows of the rank's q and k channels, v and z channels and
    b and a entries, through the contract's bound linear with the whole weight's K leaf count, so
    each output column is the one-process column;
  * the depthwise causal conv on the rank's channels (their taps, and in the engine their windows):
    ``conv_fixed_taps`` computes out[t, d] from channel d's W inputs and taps alone (products and a
    tap-ordered fp32 sum, SiLU from position-free float64 math), so a channel's bits do not depend
    on which other channels share the call;
  * ``gdn_prep_fp32`` (q/k L2 norm per head row of Dk, g and beta per element) and
    ``gated_rmsnorm_fixed`` (one row of Dv per token and value head) work per row or element;
  * the core, ``gdn_cpr_chunk`` (CPR version 4) or ``gdn_cpr`` (version 3): its lanes are (chunk or
    sequence, value head) pairs; key heads are repeated to value heads and every product, halves-tree
    sum over Dk or over a chunk's C tokens, forward substitution and float64-rounded exp stays inside a
    lane (the reference twins never mix rows; their row grouping only bounds a temporary), and each
    Triton program works on one value head (of one chunk or lane, and a Dv tile) with tiles pinned by
    (Dk, Dv) alone, never by the head count. The engine's state (boundary and running states, the
    open chunk's buffers and, for version 4, its rows of Vn and T) is per slot and head, so a rank's
    ``GDNState`` holds its own value heads and advances them as one process advances those heads;
  * out_proj row-parallel as o_proj (the contract's ``K_LEAVES``, or the stock all-reduce): its K
    columns are the value heads, which ``tp_problems`` checks fall on whole K leaves;
  * ``A_log`` and ``dt_bias`` cut by value head; the output norm's weight (one per channel of a
    head, shared by the heads) replicated.

The MLP, the lm_head and logprob and the replicated embedding, norms and residual stream are the
dense model's. ``tp_problems`` (``HybridModel``: ``tp_head_problems``, ``tp_row_parallel``,
``tp_impls``) refuses at tp > 1, before anything is cut or sent, in the one ``TopologyRefused`` of
``check_topology``: a tp that does not divide the attention heads or the Gated DeltaNet key and
value heads, a row-parallel layer whose K leaves do not fall on the ranks' head boundaries, fewer
vocabulary leaves than ranks, and regions run by other kernels than those whose per-column or
per-head schedule was read above. So under one contract, TP = 1, 2 and 4 and ``HybridModel`` in one
process give the same hidden states, logits and token logprobs, bit for bit, on every rank
(tests/dist/test_tp_hybrid_model.py, gloo on CPU).

Under the native composition (``native_tp4``, tp claimed ``variant``) the same cut runs the stock
kernels (``torch_conv1d``, ``torch_gdn_prep``, ``gdn_chunk_native``, ``torch_gated_rmsnorm``, per
channel or per head as well) with all-reduced row-parallel sums: bits close to one process's that
depend on tp (tp_dense.py, ``tp_serving_problems``; tests/dist/test_tp_native.py).

The CUDA twins of those regions are per head too by their own schedules (a Triton program per row,
or per (sequence or lane, head, Dv tile) in the core, with tiles fixed by Dk and Dv), but no GPU
run under TP has checked it; the CPU twins are what the tests run.

The engine runs on it as on ``TensorParallelDense``: a rank's KV cache holds its ``num_kv_heads /
tp`` kv heads of each attention layer (``kv_cache_heads``), its recurrent state its own value heads
and conv channels of each Gated DeltaNet layer (``allocate_recurrent_state``); ``shard_weights``
cuts full weights for ``Engine.update_weights``. The backward is the dense model's story:
deterministic for a given tp, not tp-invariant; the conv taps', ``A_log``'s and ``dt_bias``'s
gradients are a rank's own channels and heads.
"""

from __future__ import annotations

import torch
from torch import nn

from isoexec_kernels.gdn_core import GDNState

from ..dist import replicated_input, vocab_shard_range
from ..enforce import ExecutionPlan
from ..model_config import HybridConfig
from .batch import ForwardBatch
from .hybrid import HybridModel, contract_gdn_chunk, contract_gdn_chunk_form
from .tp_dense import UNIT, TensorParallelDense, mlp_cut


def _heads(n: int, tp: int, rank: int) -> tuple[int, int]:
    """Heads ``[h0, h1)`` of rank ``rank``: whole heads, contiguous (tp divides ``n``, checked)."""
    return rank * n // tp, (rank + 1) * n // tp


def _layer_cut(cfg: HybridConfig, kind: str, tp: int, rank: int, unit: int):
    """How rank ``rank`` cuts a full layer tensor of ``kind``: ``cut(name, full) -> shard`` (the
    replicated norms unchanged), the local widths of the layer's column-parallel projection's parts
    and the local gate/up width."""
    # the MoE variant (tp_moe.py) has no dense MLP (intermediate_size 0): nothing of it to cut
    mlp, inter = mlp_cut(cfg, tp, rank, unit) if cfg.intermediate_size else ((lambda name, full: None), 0)
    if kind == "full_attention":
        hd = cfg.head_dim
        q0, q1 = _heads(cfg.num_heads, tp, rank)
        k0, k1 = _heads(cfg.num_kv_heads, tp, rank)
        qs, ks = 2 * cfg.q_size, cfg.kv_size   # q rows hold [query | gate] per head
        rows = torch.cat([torch.arange(q0 * 2 * hd, q1 * 2 * hd), qs + torch.arange(k0 * hd, k1 * hd),
                          qs + ks + torch.arange(k0 * hd, k1 * hd)])
        sizes = ((q1 - q0) * 2 * hd, (k1 - k0) * hd, (k1 - k0) * hd)
        own = {"qkv_weight": lambda full: full[rows.to(full.device)],
               "o_weight": lambda full: full[:, q0 * hd:q1 * hd]}
    else:
        dk, dv, hv = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_value_heads
        a0, a1 = _heads(cfg.linear_num_key_heads, tp, rank)
        v0, v1 = _heads(hv, tp, rank)
        kd, cd, vd = cfg.key_dim, cfg.conv_dim, cfg.value_dim
        # conv channels: q of the rank's key heads, k of them, v of its value heads
        chan = torch.cat([torch.arange(a0 * dk, a1 * dk), kd + torch.arange(a0 * dk, a1 * dk),
                          2 * kd + torch.arange(v0 * dv, v1 * dv)])
        # in_proj rows: [qkv (the conv channels); z; b; a]
        rows = torch.cat([chan, cd + torch.arange(v0 * dv, v1 * dv), cd + vd + torch.arange(v0, v1),
                          cd + vd + hv + torch.arange(v0, v1)])
        sizes = (chan.numel() + (v1 - v0) * dv, 2 * (v1 - v0))   # (gdn_in_proj, gdn_ba_proj) rows
        own = {"in_proj_weight": lambda full: full[rows.to(full.device)],
               "conv_weight": lambda full: full[chan.to(full.device)],
               "A_log": lambda full: full[v0:v1], "dt_bias": lambda full: full[v0:v1],
               "out_weight": lambda full: full[:, v0 * dv:v1 * dv]}

    def cut(name: str, full: torch.Tensor) -> torch.Tensor:
        if name in own:
            return own[name](full)
        shard = mlp(name, full)
        return full if shard is None else shard   # attn_norm, q/k_norm, out_norm, mlp_norm: replicated

    return cut, sizes, inter


def cut_parameter(cfg: HybridConfig, tp: int, rank: int, name: str, full: torch.Tensor) -> torch.Tensor:
    """Rank ``rank``'s shard of the full ``HybridModel`` parameter ``name`` (works on ``meta``)."""
    if name == "lm_head":
        v0, v1 = vocab_shard_range(cfg.vocab_size, tp, rank)
        return full[v0:v1]
    if name.startswith("layers."):
        _, i, leaf = name.split(".", 2)
        return _layer_cut(cfg, cfg.layer_types[int(i)], tp, rank, UNIT)[0](leaf, full)
    return full    # embed, final_norm: replicated


class _LayerShard(nn.Module):
    """One layer's shards, under the full layer's parameter names (so ``shard_weights`` and
    ``Engine.update_weights`` match them by name)."""

    def __init__(self, layer, cfg: HybridConfig, tp: int, rank: int, unit: int):
        super().__init__()
        self.kind = layer.kind
        cut, self.sizes, self.inter = _layer_cut(cfg, layer.kind, tp, rank, unit)
        for name, full in layer.named_parameters(recurse=False):
            setattr(self, name, nn.Parameter(cut(name, full.detach()).clone()))


class TensorParallelHybrid(TensorParallelDense):
    """This rank's shards of ``model`` (a ``HybridModel`` with a contract installed) on ``group``
    (None: the default group, or one process if none is initialised). Module docstring."""

    FAMILY = "hybrid"
    WHAT = "tensor-parallel hybrid model"

    def __init__(self, model: HybridModel, group=None):
        super().__init__(model, group)
        cfg, tp = self.cfg, self.tp
        # the Gated DeltaNet heads and conv channels this rank computes and its engine state holds
        self.gdn_key_heads = cfg.linear_num_key_heads // tp
        self.gdn_value_heads = cfg.linear_num_value_heads // tp
        self.gdn_conv_channels = 2 * self.gdn_key_heads * cfg.linear_key_head_dim + \
            self.gdn_value_heads * cfg.linear_value_head_dim

    def shard_layers(self, model) -> list[nn.Module]:
        return [_LayerShard(L, self.cfg, self.tp, self.rank, UNIT) for L in model.layers]

    def cut_parameter(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return cut_parameter(self.cfg, self.tp, self.rank, name, full)

    # ------------------------------------------------------------------------------ engine state
    def allocate_recurrent_state(self, num_slots: int, device=None) -> tuple[list, list[torch.Tensor]]:
        """``HybridModel.allocate_recurrent_state`` for this rank's value heads and conv channels:
        per Gated DeltaNet layer one ``GDNState`` [S, Hv / tp, Dk, Dv] and one conv window
        [S, local channels, W-1], all zero."""
        cfg = self.cfg
        device = device or self.embed.device
        chunk = contract_gdn_chunk(self.contract)
        with_q = contract_gdn_chunk_form(self.contract)
        gdn = [GDNState.allocate(num_slots, self.gdn_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                 device, chunk=chunk, with_q=with_q, value_dtype=self.embed.dtype)
               for _ in cfg.gdn_layers]
        conv = [torch.zeros((num_slots, self.gdn_conv_channels, cfg.linear_conv_kernel_dim - 1),
                            dtype=self.embed.dtype, device=device) for _ in cfg.gdn_layers]
        return gdn, conv

    reset_recurrent_state = staticmethod(HybridModel.reset_recurrent_state)

    # ------------------------------------------------------------------------------ forward
    def _gated_attention(self, plan: ExecutionPlan, kv_layer: int, L: _LayerShard, n, batch: ForwardBatch
                         ) -> torch.Tensor:
        """The rank's heads of a gated attention layer; o_proj row-parallel (``_row_parallel``)."""
        cfg, tp = self.cfg, self.tp
        qkv = self._column(plan, ("q_proj", "k_proj", "v_proj"), n, L.qkv_weight,
                           (2 * cfg.q_size, cfg.kv_size, cfg.kv_size), L.sizes)
        # the one-process per-head steps (packed attention, or the paged cache of this rank's heads)
        a = HybridModel._gated_attention_heads(self, plan, kv_layer, L, qkv, cfg.num_heads // tp,
                                               cfg.num_kv_heads // tp, batch, self._rope)
        return self._row_parallel(plan, "o_proj", a, L.o_weight, cfg.q_size)

    def _gated_deltanet(self, plan: ExecutionPlan, gdn_layer: int, L: _LayerShard, n, batch: ForwardBatch
                        ) -> torch.Tensor:
        """The rank's heads of a Gated DeltaNet layer; out_proj row-parallel (``_row_parallel``)."""
        cfg = self.cfg
        proj = self._column(plan, ("gdn_in_proj", "gdn_ba_proj"), n, L.in_proj_weight,
                            (cfg.conv_dim + cfg.value_dim, 2 * cfg.linear_num_value_heads), L.sizes)
        # the one-process conv, prep, core and gated norm on this rank's channels and heads (and in
        # the engine on its conv windows and GDN state)
        o = HybridModel._gated_deltanet_heads(self, plan, gdn_layer, L, proj, self.gdn_key_heads,
                                              self.gdn_value_heads, batch)
        return self._row_parallel(plan, "gdn_out_proj", o, L.out_weight, cfg.value_dim)

    def hidden_states(self, ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Final-norm hidden states [T, H] of the tokens ``ids`` [T], replicated on every rank:
        the bits of ``HybridModel.hidden_states`` under the same contract. An engine batch's KV
        cache and recurrent state hold this rank's heads."""
        cfg, plan = self.cfg, self._plan(batch.case)
        eps = cfg.rms_norm_eps
        x = plan["embed"](ids, self.embed)
        kv_layer = gdn_layer = 0
        for L in self.layers:
            n = replicated_input(plan["attn_norm"](x, L.attn_norm, eps, zero_centred=True), self.group)
            if L.kind == "full_attention":
                x = x + self._gated_attention(plan, kv_layer, L, n, batch)
                kv_layer += 1
            else:
                x = x + self._gated_deltanet(plan, gdn_layer, L, n, batch)
                gdn_layer += 1
            x = x + self._mlp(plan, L, plan["mlp_norm"](x, L.mlp_norm, eps, zero_centred=True))
        return plan["final_norm"](x, self.final_norm, eps, zero_centred=True)


__all__ = ["TensorParallelHybrid", "cut_parameter"]
