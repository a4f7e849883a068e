"""Token logprobs and log-softmax: the fixed-order torch twin (runs on any device; the CPU path of the
public API). The rounding schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import torch

from .. import _ref


REF_LEAF_V = 1024
"""Reference vocabulary leaf (halves tree inside, leaves in order). Pinned in the contract."""


def _rows(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() < 1:
        raise ValueError("logprob: logits must be [..., V]")
    V = logits.shape[-1]
    t = logits.reshape(-1, V)
    return t if t.stride(-1) == 1 else t.contiguous()


def _ref_stats(z: torch.Tensor):
    """(m, zm, lse_rel) for fp32 rows z [R, V]: zm = z - m, lse_rel = log(sum exp(zm))."""
    m = z.max(dim=-1).values + 0.0
    zm = z - m[:, None]
    e = _ref.exp64(zm.double()).float()
    s = _ref.blocked_sum(e, 1, REF_LEAF_V)
    lse_rel = _ref.log64(s.double()).float()
    return zm, lse_rel


def _ref_chunks(z2: torch.Tensor):
    R, V = z2.shape
    rows = _ref.rows_per_chunk(V, budget=1 << 19)
    for r0 in range(0, R, rows):
        yield r0, z2[r0:r0 + rows].float()


def token_logprobs_reference(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """fp32 ``log_softmax(logits)[t, targets[t]]`` by the reference schedule."""
    z2 = _rows(logits)
    tg = targets.reshape(-1).long()
    if tg.shape[0] != z2.shape[0]:
        raise ValueError(f"token_logprobs: {z2.shape[0]} logit rows but {tg.shape[0]} targets")
    out = torch.empty(z2.shape[0], dtype=torch.float32, device=z2.device)
    if z2.shape[1] == 0:
        raise ValueError("token_logprobs: empty vocabulary")
    for r0, z in _ref_chunks(z2):
        zm, lse_rel = _ref_stats(z)
        zt = zm.gather(1, tg[r0:r0 + z.shape[0], None])[:, 0]
        out[r0:r0 + z.shape[0]] = zt - lse_rel
    return out.reshape(targets.shape)


def log_softmax_reference(logits: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last dim by the reference schedule."""
    z2 = _rows(logits)
    out = torch.empty(z2.shape, dtype=torch.float32, device=z2.device)
    for r0, z in _ref_chunks(z2):
        zm, lse_rel = _ref_stats(z)
        out[r0:r0 + z.shape[0]] = zm - lse_rel[:, None]
    return out.reshape(logits.shape)
