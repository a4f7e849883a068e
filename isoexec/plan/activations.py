"""Activation headroom: an estimate, stated as an assumption (the other lines of the plan are read
off the allocations; this one is not).

What it assumes. Without activation checkpointing the trainer keeps, for the backward of one
micro-batch, every tensor a decoder layer passes between its ops, once each, in the compute dtype,
for every layer; plus the micro-batch's logits and two fp32 ``[tokens, vocab]`` tensors (the
logprob's fp32 working rows and the logits' gradient). With ``train.activation_checkpointing``
every layer runs under ``torch.utils.checkpoint``: the forward keeps only each layer's input (one
hidden row per token and layer), and the backward recomputes one layer at a time, so one layer's
tensors (the widest layer's) are alive on top of those inputs. The tensors of a layer, per token:

- around each of its two blocks: the norm's input, the normed rows and the block's output (3 x hidden);
- GQA attention: q/k/v, q and k after their norms and after RoPE, the attention output
  (the hybrids' gated attention: q_proj's gate half and the gated output too);
- Gated DeltaNet: the fused input projection, the conv output, the prepared q/k, decays and betas,
  the core's output and the gated norm's;
- MLA: the latent projections and their norms, the up-projected q and kv, the rotated parts, the
  expanded (padded) q/k/v, the attention output and o_proj's input;
- SwiGLU MLP: gate/up and the activation; MoE: the router's scores, each token's top-k copies
  through its experts (input, gate/up, activation, output), the shared expert.

A micro-batch holds ``micro_batch_tokens``, or one whole sequence when that is longer (sequences
are never split, ``pack_by_tokens``). The engine's step (no autograd) holds one layer's tensors at a
time for ``max_num_batched_tokens`` tokens, plus the sampled rows' logits and two fp32
``[rows, vocab]`` working tensors; rollout and training alternate, so the plan takes the larger of
the two. Not counted: CUDA graph pools, the CUDA context, allocator fragmentation.
``tests/plan/test_activations.py`` compares the estimate with the tensors autograd saves for the
tiny models.
"""

from __future__ import annotations

from ..model_config import DenseConfig, HybridConfig, HybridMoeConfig, MlaMoeConfig

LOGIT_FP32_COPIES = 2


def _gqa(cfg, gated: bool) -> int:
    q, kv = cfg.q_size, cfg.kv_size
    if gated:   # q_proj's rows are [query | gate]; the gated output before o_proj
        return (2 * q + 2 * kv) + 2 * (q + kv) + q + q
    return (q + 2 * kv) + 2 * (q + kv) + q


def _gdn(cfg: HybridConfig) -> int:
    hv = cfg.linear_num_value_heads
    return ((cfg.conv_dim + cfg.value_dim + 2 * hv) + cfg.conv_dim + 2 * cfg.key_dim + 2 * hv
            + 2 * cfg.value_dim)


def _mla(cfg: MlaMoeConfig) -> int:
    nh, ql, kl, rope = cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    return ((ql + kl + rope) + ql + nh * cfg.qk_head_dim + kl + nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)
            + (nh * rope + rope) + 3 * nh * cfg.attn_width + nh * cfg.attn_width + nh * cfg.v_head_dim)


def _moe(h: int, experts: int, top_k: int, inter: int, shared: int) -> int:
    routed = top_k * (h + 2 * inter + inter + h)
    return experts + routed + (3 * shared + h if shared else 0)


def layer_widths(cfg) -> list[int]:
    """Elements per token that each decoder layer keeps for its backward (the module docstring)."""
    h = cfg.hidden_size
    around = 2 * 3 * h
    if isinstance(cfg, DenseConfig):
        return [around + _gqa(cfg, False) + 3 * cfg.intermediate_size] * cfg.num_layers
    if isinstance(cfg, HybridConfig):
        if isinstance(cfg, HybridMoeConfig):
            mlp = _moe(h, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                       cfg.shared_expert_intermediate_size)
        else:
            mlp = 3 * cfg.intermediate_size
        return [around + (_gqa(cfg, True) if t == "full_attention" else _gdn(cfg)) + mlp for t in cfg.layer_types]
    if isinstance(cfg, MlaMoeConfig):
        moe = _moe(h, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                   cfg.shared_intermediate_size)
        return [around + _mla(cfg) + (3 * cfg.intermediate_size if t == "dense" else moe)
                for t in cfg.mlp_layer_types]
    raise TypeError(f"layer_widths: no activation layout for {type(cfg).__name__}")


def logit_bytes_per_row(cfg, dtype_bytes: int) -> int:
    """The logits of one row in the compute dtype and the fp32 working copies."""
    return cfg.vocab_size * (dtype_bytes + 4 * LOGIT_FP32_COPIES)


def trainer_activation_bytes(cfg, tokens: int, dtype_bytes: int, checkpointing: bool = False) -> int:
    """One micro-batch of ``tokens`` tokens through the trainer's forward and backward; with
    ``checkpointing`` each layer keeps its input and one layer at a time is recomputed."""
    widths = layer_widths(cfg)
    kept = len(widths) * cfg.hidden_size + max(widths) if checkpointing else sum(widths)
    return tokens * (kept * dtype_bytes + logit_bytes_per_row(cfg, dtype_bytes))


def engine_activation_bytes(cfg, step_tokens: int, sampled_rows: int, dtype_bytes: int) -> int:
    """One engine step of ``step_tokens`` tokens that samples ``sampled_rows`` rows."""
    return step_tokens * max(layer_widths(cfg)) * dtype_bytes + sampled_rows * logit_bytes_per_row(cfg, dtype_bytes)


def micro_batch_tokens(budget: int, longest_sequence: int) -> int:
    """Tokens of the largest micro-batch: the budget, or one sequence longer than it."""
    return max(budget, longest_sequence)
