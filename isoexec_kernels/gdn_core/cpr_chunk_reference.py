"""Reference twin of CPR version 4 (``cpr_chunk.py``, impl ``gdn_cpr_chunk``): the same chunk form with the
same rounding points, from IEEE basic operations in a fixed order, so that on any CPU its trainer,
engine prefill split anywhere and decode agree bitwise by construction (its bits are not the GPU's).

Per chunk of C rows (a piece's last chunk padded with zero rows: g = beta = k = v = q = 0), value
head h, ``r`` = rounding to bf16 (nearest even) where the kernels round an operand or a stored value
(for values that are not fp32; with fp32 values ``r`` is the identity, as the kernels' tf32x3 dots
are fp32-accurate: ``cpr_chunk.cpr4_choice``):

    G     running sums inside each 16-row block plus the sums of the blocks before it
    A_ij  = (beta_i * (r(k_i) . r(k_j))) * exp(G_i - G_j)  for j < i, else 0
    T     = (I + A)^-1: diagonal 16-row blocks by forward substitution, the blocks below by
            T_ab = -T_aa (A_ab T_bb + A_a,b+1 T_b+1,b + ...)          (fp32)
    W     = r(r(T) @ r(k * beta e^G))       U = r(r(T) @ r(v * beta))
    Vn    = U - r(W) @ r(S)                 vn = r(Vn)
    S'    = r(k)^T @ r(Vn * e^(Gl - G)) + S * e^Gl        (S fp32, chained over the piece's chunks)
    o     = e^G * (r(q) @ r(S)) + r(M) @ vn,  M_ij = (r(q_i) . r(k_j)) exp(G_i - G_j) for j <= i

Every dot product is the halves tree of ``_ref.tree_sum0`` over its contraction (zero-padded to a
power of two), every exp is ``_ref.exp64`` rounded once. Row t of each of these depends only on
rows 0..t of its chunk (strict / inclusive masks, lower-triangular T; a later row enters only as an
exact zero term), which is what lets decode recompute the open chunk's prefix.
"""

from __future__ import annotations

import torch

from . import cpr_chunk, native_wy
from .plan import chunk_plan
from .reference import _exp, _mm, block_cumsum_reference, blocked_inverse_reference
from .state import CHUNK, GDNState


def _forward_reference(pq, pk, pv, pg, pb, starts, lens, init, C):
    """The chunk form over pieces, as ``cpr_chunk._forward_triton`` (same returns; q and k on the key
    heads or already repeated to the value heads)."""
    H, Dk, Dv = pv.shape[1], pk.shape[2], pv.shape[2]
    pq, pk = cpr_chunk._expand(pq, H), cpr_chunk._expand(pk, H)
    dev = pv.device
    B = len(lens)
    row0, nrow, _sidx, chunk0, nchunk, _s0, _ns = chunk_plan(starts, lens, C)
    P = len(row0)
    o = torch.zeros(pk.shape[0], H, Dv, dtype=torch.float32, device=dev)
    fin = torch.zeros(B, H, Dk, Dv, dtype=torch.float32, device=dev)
    if P == 0:
        return o, None, fin, None, None
    # the operand rounding of ``cpr_chunk.cpr4_choice``: to bf16 for values that are not fp32 (looked
    # up per call: the interpreter tests swap in truncation), none for fp32 values (tf32x3 dots)
    r = (lambda x: x) if pv.dtype == torch.float32 else native_wy.round_bf16
    t = torch.arange(C, device=dev)
    src = torch.tensor(row0, device=dev)[:, None] + t[None, :]                  # [P, C]
    ok = t[None, :] < torch.tensor(nrow, device=dev)[:, None]

    def chunks(x):   # [rows, H, ...] -> [P * H, C, ...] zero-padded, heads as lanes
        y = torch.where(ok.view(P, C, *([1] * (x.dim() - 1))), x.float()[src.clamp(max=x.shape[0] - 1)], 0.0)
        return y.movedim(2, 1).reshape(P * H, C, *x.shape[2:])

    Q, K, V, g, beta = chunks(pq), chunks(pk), chunks(pv), chunks(pg), chunks(pb)
    G = block_cumsum_reference(g)
    strict = t[None, :] < t[:, None]
    incl = t[None, :] <= t[:, None]
    zero = torch.zeros((), dtype=torch.float32, device=dev)
    dG = G[:, :, None] - G[:, None, :]
    # exp(G_i - G_j) for j <= i, exp(0) = 1 elsewhere: A's strict mask and M's inclusive one take the
    # same values (on the diagonal G_i - G_i is +0 either way), so one exp serves both
    eG = _exp(torch.where(incl, dG, zero))
    Kr = r(K)
    A = torch.where(strict, (beta[:, :, None] * _mm(Kr, Kr.transpose(1, 2))) * eG, zero)
    T_raw = blocked_inverse_reference(A)
    Tm = r(T_raw)
    W = r(_mm(Tm, r(K * (beta * _exp(G))[:, :, None])))
    U = r(_mm(Tm, r(V * beta[:, :, None])))
    states = torch.empty(P, H, Dk, Dv, dtype=torch.float32, device=dev)
    vn = torch.empty(P * H, C, Dv, dtype=torch.float32, device=dev)
    vn_raw = torch.empty_like(vn)   # unrounded, as the engine keeps the open chunk's
    okl = ok.repeat_interleave(H, 0)                                              # [P * H, C]
    for b in range(B):
        S = (init[b].float() if init is not None else torch.zeros(H, Dk, Dv, device=dev))
        for c in range(chunk0[b], chunk0[b] + nchunk[b]):
            lanes = slice(c * H, (c + 1) * H)
            states[c] = S
            Vn = U[lanes] - _mm(W[lanes], r(S))
            vn[lanes] = r(Vn)
            vn_raw[lanes] = Vn
            gl = G[lanes, nrow[c] - 1]
            Vd = Vn * torch.where(okl[lanes], _exp(gl[:, None] - G[lanes]), zero)[:, :, None]
            S = _mm(Kr[lanes].transpose(1, 2), r(Vd)) + S * _exp(gl)[:, None, None]
        fin[b] = S
    Sr = r(states).view(P * H, Dk, Dv)
    M = torch.where(incl & okl[:, :, None], _mm(r(Q), Kr.transpose(1, 2)) * eG, zero)
    out = _mm(r(Q), Sr) * _exp(G)[:, :, None] + _mm(r(M), vn)                    # [P * H, C, Dv]
    out = out.view(P, H, C, Dv).movedim(1, 2)                                      # [P, C, H, Dv]
    o[src[ok]] = out[ok]
    return o, states, fin, vn_raw.view(P, H, C, Dv), T_raw.view(P, H, C, C)


def cpr4_varlen_reference(q, k, v, g, beta, cu_seqlens, *, chunk: int = CHUNK) -> torch.Tensor:
    """Trainer: each sequence from the zero state; o [T, H, Dv] fp32."""
    cu = cu_seqlens.tolist()
    H = v.shape[1]
    starts, lens = cu[:-1], [b - a for a, b in zip(cu[:-1], cu[1:])]
    return _forward_reference(cpr_chunk._expand(q, H), cpr_chunk._expand(k, H), v, g, beta, starts, lens,
                              None, chunk)[0]


def cpr4_engine_reference(q, k, v, g, beta, cu_seqlens_q, slots, state: GDNState, *, chunk: int = CHUNK,
                          host=None) -> torch.Tensor:
    """Engine prefill (``cpr_chunk.engine_step`` on this twin's forward; ``host``: its
    ``plan.HostPlan``)."""
    return cpr_chunk.engine_step(q, k, v, g, beta, cu_seqlens_q, slots, state, chunk, _forward_reference, host)


def cpr4_decode_reference(q, k, v, g, beta, slots, state: GDNState, *, chunk: int = CHUNK) -> torch.Tensor:
    """Engine decode: a prefill of one token per lane (the same computation as the Triton twin's
    decode: the open chunk's rows so far from the slot's boundary)."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return cpr4_engine_reference(q, k, v, g, beta, cu, slots, state, chunk=chunk)
