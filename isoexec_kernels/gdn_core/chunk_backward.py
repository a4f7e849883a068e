"""Backward of the gated delta rule's chunk form (``chunk_form.torch_chunk_form``): fused Triton
kernels and their torch reference twin.

Every trainer path (CPR's ``gdn_cpr_varlen`` and the native chunk path) takes its gradients from
``chunk_form.chunk_form_backward``; for CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``)
that function calls :func:`chunk_backward_triton` below instead of differentiating the torch chunk
form with autograd. Only the forward is on the invariant path; this backward is correct at fp32
tolerance and deterministic run to run (same inputs, same gradient bits), not batch invariant.

The function differentiated
---------------------------
Sequences are cut into chunks of C tokens from each sequence's first token (the last chunk of a
sequence may be partial: its missing rows act as zero padding, g = beta = 0, q = k = v = 0). For
one value head h (key head ``h // REP``, ``REP = H / Hk``) and one chunk, with S the state that
enters the chunk (zero for a sequence's first chunk)::

    G    = cumsum(g)                       Gl = G[C-1]        el = exp(Gl)
    Gam  = exp(G_i - G_j) for j <= i, else 0                       (decay matrix)
    KK   = k k^T     qk = q k^T
    A    = strict_lower(beta_i * KK * Gam)     T = (I + A)^-1
    Vb   = v * beta      Kb = k * (beta exp(G))      U = T Vb      W = T Kb
    Kd   = k * exp(Gl - G)       Qd = q * exp(G)       M = incl_lower(qk * Gam)
    Vn   = U - W S
    o    = Qd S + M Vn
    S'   = el S + Kd^T Vn

The gradient (given dO = dL/do; the final state is not an output, so dS' = 0 after the last chunk)
--------------------------------------------------------------------------------------------------
1. Reverse pass over the chunks of a sequence. Write dS' for the gradient reaching the state that
   leaves the chunk. Vn feeds o (through M) and S' (through Kd), and S feeds Vn, o and S', so::

       dVn = M^T dO + Kd dS'
       dS  = el dS' + Qd^T dO - W^T dVn          (the dS' of the previous chunk)

   The state-independent parts ``dVloc = M^T dO`` and ``dSloc = Qd^T dO`` are computed for all
   chunks in parallel first; the sequential pass then only needs two small products per chunk.
2. Local gradients of one chunk, from S (entering state, recomputed by a forward pass), dS',
   Vn and dVn::

       dU  = dVn                 dW  = -dVn S^T           dQd = dO S^T
       dM  = dO Vn^T             dKd = Vn dS'^T           del = sum(S * dS')
       dT  = dU Vb^T + dW Kb^T = dVn (Vb - Kb S)^T
       dVb = T^T dU              dKb = T^T dW
       dA  = strict_lower(-T^T dT T^T)                    (d(X^-1) = -X^-1 dX X^-1)

   Then through the elementwise definitions (dMG = incl_lower(dM * Gam) is the gradient of qk;
   D = dA * beta_i * Gam is the gradient of KK on the strict lower triangle)::

       dq    = dMG k + dQd * exp(G)
       dk    = dMG^T q + (D + D^T) k + dKd * exp(Gl - G) + dKb * beta exp(G)
       dv    = dVb * beta
       dbeta = rowsum(dVb * v) + rowsum(dKb * k) exp(G) + rowsum(dA * KK * Gam)

   and the gradient of the cumulative sums G: each entry of a matrix of the form X_ij exp(G_i - G_j)
   sends +P_ij to G_i and -P_ij to G_j, with P = dMG * qk (for M) and P = dA * A (for A)::

       dG  = rowsum(P_M) - colsum(P_M) + rowsum(P_A) - colsum(P_A)
             + rowsum(dQd * Qd) + rowsum(dKb * Kb) - rowsum(dKd * Kd)
       dGl = el * del + sum(dKd * Kd)          added to dG[C-1]
       dg  = reverse cumulative sum of dG      (dg_t = sum over s >= t of dG_s)

   A padded row of a partial chunk contributes exactly zero to every sum above except through
   Gl, which is G at the last valid row (padding has g = 0), so adding dGl at row C-1 and taking
   the reverse cumulative sum gives the valid rows the right gradient.
3. GQA: q and k of key head kh are used by the REP value heads kh*REP .. kh*REP + REP - 1. Each
   value head's dq, dk are written to a per-value-head buffer [T, H, Dk] and summed over the REP
   heads by one ``torch.sum`` over that axis (a fixed reduction for a given shape: no atomics).

Triton decomposition (``chunk_backward_triton``), one launch each, chunks at each sequence start
-----------------------------------------------------------------------------------------------
(a) ``launch_prep`` of ``triton_kernels.py`` (the forward's prep kernel, reused with T stored):
    one program per (chunk, value head): G, KK, A, T by forward substitution, W, U, Kd, el.
(b) ``launch_state`` of ``triton_kernels.py`` (the forward's state kernel, reused): the entering
    state S of every chunk and Vn, sequential over the chunks of a sequence.
(c) ``_bwd_dout_kernel``   one program per (chunk, value head, Dv tile): dVloc = M^T dO and
    dSloc = Qd^T dO.
(d) ``_bwd_state_kernel``  one program per (sequence, value head, Dv tile): the reverse pass of
    step 1; stores dS' and dVn for every chunk.
(e) ``_bwd_local_kernel``  one program per (chunk, value head): step 2; writes dv, dg, dbeta and
    the per-value-head dq, dk; then the GQA sum of step 3.

Precision and order. Every ``tl.dot`` takes fp32 operands and accumulates in fp32, with
``BWD_DOT_PRECISION`` = ``"tf32x3"``: each operand is split into a TF32 high part and a TF32
remainder and three tensor-core products are summed, which keeps close to fp32 accuracy (plain TF32
rounds the operands to 10 mantissa bits, about 1e-3 relative) while running on the tensor cores;
``"ieee"`` is exact fp32 but runs on the CUDA cores, several times slower. This is the backward,
not the invariant forward, so it needs accuracy and determinism, not the forward's rounding. (For
scale: the fp32 reference twin is 4e-7 .. 7e-7 relative L2 from float64 at Dk = Dv = 128,
C = 64, 2 x 2048 tokens; tf32x3 on the H200 is not measured.) Each program reduces in a fixed
order: dots over Dk or Dv in blocks of ``BLOCK_DK`` / ``BLOCK_DV`` accumulated block by block in
order, ``tl.sum`` and ``tl.cumsum`` over register tiles, the dS chain sequential in chunk order; no
atomics, no reductions split across programs, tiles and warps fixed by (Dk, Dv). So two calls on
the same inputs give the same bits. Results depend on a chunk's place in the batch only through
the rows it holds, but the backward is not claimed batch invariant (it is not on the invariant
path).

Memory (fp32 scratch, P chunks, N = P + number of sequences): T [P, H, C, C]; W, Kd [P, H, C, Dk];
U, Vn, dVloc, dVn [P, H, C, Dv]; entering states [N, H, Dk, Dv]; dSloc, dS' [P, H, Dk, Dv]; the
per-value-head dq, dk [T, H, Dk]. At 5 x 2048 tokens, H = 32, Dk = Dv = 128, C = 64 that is about
2.4 GB (U is dropped after (b); W, Kd, dVloc and dSloc after (d)).

Reference twin (``chunk_backward_reference``): the same decomposition with stock torch ops,
vectorised over chunks and heads (padded [B, H, chunks, C, ...] layout, T by
``torch.linalg.solve_triangular``), with Python loops over the chunks only for the two state
passes. It runs in the inputs' precision (float64 for float64 inputs).

NOT run on a GPU by the author: the kernels ran only in the Triton CPU interpreter (where tl.dot
is numpy's matmul and the precision argument is ignored). Speed, register pressure of
``_bwd_local_kernel`` (several [C, C] tiles and a [C, Dk] tile live at once; num_warps 8) and the
tf32x3 accuracy on the H200 are not measured. Known speed gap: T is inverted by C - 1 row steps
(as in the forward's prep kernel), not by a blocked inverse.
"""

from __future__ import annotations

import torch

from .._triton_util import jit, next_pow2, tl
from .padding import _pad_seqs, _prepare, _unpad_seqs
from .plan import _host_lens, chunk_plan
from .state import CHUNK
from .triton_kernels import _i32, _rows3, launch_prep, launch_state, triton_cdiv


BWD_DOT_PRECISION = "tf32x3"
"""``tl.dot`` input precision of the backward kernels (fp32 accuracy on tensor cores)."""
BLOCK_DK = 32
"""Dk block of the backward kernels (dots over Dk accumulated block by block in order)."""
BLOCK_DV = 32
"""Dv block / tile of the backward kernels."""


def bwd_tile_constants(Dk: int, Dv: int) -> dict:
    """Tiles and warps of the backward kernels: a function of (Dk, Dv) only."""
    return dict(DKP=max(16, next_pow2(Dk)), DVP=max(16, next_pow2(Dv)),
                BK=min(BLOCK_DK, max(16, next_pow2(Dk))), BV=min(BLOCK_DV, max(16, next_pow2(Dv))),
                dout_warps=4, state_warps=8, local_warps=8)


# --------------------------------------------------------------------------- Triton kernels


@jit
def _bwd_dout_kernel(
    q_ptr, k_ptr, g_ptr, do_ptr, row0_ptr, nrow_ptr, dvl_ptr, dsl_ptr,
    H, REP, DK, DV, s_qt, s_qh, s_kt, s_kh, s_gt, s_dt, s_dh,
    C: tl.constexpr, DKP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    # One program per (chunk p, value head h, Dv tile): dVloc = M^T dO, dSloc = Qd^T dO.
    p = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vt = tl.program_id(2)
    n = tl.load(nrow_ptr + p)
    r0 = tl.load(row0_ptr + p).to(tl.int64)
    kh = h // REP
    t = tl.arange(0, C)
    ok = t < n
    rows = r0 + t
    dv = vt * BV + tl.arange(0, BV)
    vm = dv[None, :] < DV
    g = tl.load(g_ptr + rows * s_gt + h, mask=ok, other=0.0).to(tl.float32)
    G = tl.cumsum(g, axis=0)
    eG = tl.exp(G)
    dO = tl.load(do_ptr + rows[:, None] * s_dt + h * s_dh + dv[None, :], mask=ok[:, None] & vm,
                 other=0.0).to(tl.float32)
    qk = tl.zeros((C, C), dtype=tl.float32)
    for d0 in tl.static_range(0, DKP, BK):
        dc = d0 + tl.arange(0, BK)
        dm = dc[None, :] < DK
        qb = tl.load(q_ptr + rows[:, None] * s_qt + kh * s_qh + dc[None, :], mask=ok[:, None] & dm,
                     other=0.0).to(tl.float32)
        kb = tl.load(k_ptr + rows[:, None] * s_kt + kh * s_kh + dc[None, :], mask=ok[:, None] & dm,
                     other=0.0).to(tl.float32)
        qk = tl.dot(qb, tl.trans(kb), qk, input_precision=PREC)
        dsl = tl.dot(tl.trans(qb * eG[:, None]), dO, input_precision=PREC)  # [BK, BV]
        tl.store(dsl_ptr + ((p * H + h) * DK + dc[:, None]) * DV + dv[None, :], dsl,
                 mask=(dc[:, None] < DK) & vm)
    i2 = t[:, None]
    j2 = t[None, :]
    incl = j2 <= i2
    M = tl.where(incl, qk * tl.exp(tl.where(incl, G[:, None] - G[None, :], 0.0)), 0.0)
    dvl = tl.dot(tl.trans(M), dO, input_precision=PREC)
    tl.store(dvl_ptr + ((p * H + h) * C + i2) * DV + dv[None, :], dvl, mask=vm)


@jit
def _bwd_state_kernel(
    w_ptr, kd_ptr, el_ptr, dvl_ptr, dsl_ptr, dsn_ptr, dvn_ptr, chunk0_ptr, nchunk_ptr,
    H, DK, DV,
    C: tl.constexpr, DKP: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    # One program per (sequence p, value head h, Dv tile): the reverse pass over the sequence's
    # chunks, last to first. dS (gradient of the state leaving the chunk) starts at zero.
    p = tl.program_id(0)
    h = tl.program_id(1)
    vt = tl.program_id(2)
    n = tl.load(nchunk_ptr + p)
    c0 = tl.load(chunk0_ptr + p).to(tl.int64)
    dk = tl.arange(0, DKP)
    dv = vt * BV + tl.arange(0, BV)
    km = dk[None, :] < DK
    vm = dv[None, :] < DV
    sm = (dk[:, None] < DK) & vm
    t = tl.arange(0, C)
    dS = tl.zeros((DKP, BV), dtype=tl.float32)
    for i in range(0, n):
        q = (c0 + (n - 1 - i)) * H + h
        soff = (q * DK + dk[:, None]) * DV + dv[None, :]
        tl.store(dsn_ptr + soff, dS, mask=sm)
        W = tl.load(w_ptr + (q * C + t[:, None]) * DK + dk[None, :], mask=km, other=0.0)
        Kd = tl.load(kd_ptr + (q * C + t[:, None]) * DK + dk[None, :], mask=km, other=0.0)
        voff = (q * C + t[:, None]) * DV + dv[None, :]
        dVn = tl.load(dvl_ptr + voff, mask=vm, other=0.0) + tl.dot(Kd, dS, input_precision=PREC)
        tl.store(dvn_ptr + voff, dVn, mask=vm)
        dsl = tl.load(dsl_ptr + soff, mask=sm, other=0.0)
        el = tl.load(el_ptr + q)
        dS = dS * el + dsl - tl.dot(tl.trans(W), dVn, input_precision=PREC)


@jit
def _bwd_local_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, do_ptr, row0_ptr, nrow_ptr, sidx_ptr,
    t_ptr, vn_ptr, dvn_ptr, st_ptr, dsn_ptr,
    dq_ptr, dk_ptr, dv_ptr, dg_ptr, db_ptr,
    H, REP, DK, DV, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_bt, s_dt, s_dh,
    C: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr,
):
    # One program per (chunk p, value head h): the local gradients (module docstring, step 2).
    # dq, dk go to per-value-head buffers [T, H, Dk] (contiguous); dv [T, H, Dv]; dg, dbeta [T, H].
    p = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    n = tl.load(nrow_ptr + p)
    r0 = tl.load(row0_ptr + p).to(tl.int64)
    si = tl.load(sidx_ptr + p).to(tl.int64)
    kh = h // REP
    t = tl.arange(0, C)
    ok = t < n
    rows = r0 + t
    i2 = t[:, None]
    j2 = t[None, :]
    incl = j2 <= i2
    strict = j2 < i2
    g = tl.load(g_ptr + rows * s_gt + h, mask=ok, other=0.0).to(tl.float32)
    beta = tl.load(b_ptr + rows * s_bt + h, mask=ok, other=0.0).to(tl.float32)
    G = tl.cumsum(g, axis=0)
    eG = tl.exp(G)
    g_last = tl.sum(tl.where(t == C - 1, G, 0.0), axis=0)
    el = tl.exp(g_last)
    tail = tl.exp(g_last - G)
    coef = beta * eG
    Gam = tl.where(incl, tl.exp(tl.where(incl, G[:, None] - G[None, :], 0.0)), 0.0)
    pc = p * H + h
    # q k^T and k k^T over Dk blocks (in order); the full key tile for Kb S
    qk = tl.zeros((C, C), dtype=tl.float32)
    kk = tl.zeros((C, C), dtype=tl.float32)
    for d0 in tl.static_range(0, DKP, BK):
        dc = d0 + tl.arange(0, BK)
        dm = ok[:, None] & (dc[None, :] < DK)
        qb = tl.load(q_ptr + rows[:, None] * s_qt + kh * s_qh + dc[None, :], mask=dm, other=0.0).to(tl.float32)
        kb = tl.load(k_ptr + rows[:, None] * s_kt + kh * s_kh + dc[None, :], mask=dm, other=0.0).to(tl.float32)
        qk = tl.dot(qb, tl.trans(kb), qk, input_precision=PREC)
        kk = tl.dot(kb, tl.trans(kb), kk, input_precision=PREC)
    dkf = tl.arange(0, DKP)
    Kb = tl.load(k_ptr + rows[:, None] * s_kt + kh * s_kh + dkf[None, :],
                 mask=ok[:, None] & (dkf[None, :] < DK), other=0.0).to(tl.float32) * coef[:, None]
    Tm = tl.load(t_ptr + (pc * C + i2) * C + j2)
    # phase 1: over Dv tiles -> dM, dT, dv, the v part of dbeta
    dM = tl.zeros((C, C), dtype=tl.float32)
    dT = tl.zeros((C, C), dtype=tl.float32)
    dbeta = tl.zeros((C,), dtype=tl.float32)
    for v0 in tl.static_range(0, DVP, BV):
        vc = v0 + tl.arange(0, BV)
        vm = vc[None, :] < DV
        dO = tl.load(do_ptr + rows[:, None] * s_dt + h * s_dh + vc[None, :], mask=ok[:, None] & vm,
                     other=0.0).to(tl.float32)
        vv = tl.load(v_ptr + rows[:, None] * s_vt + h * s_vh + vc[None, :], mask=ok[:, None] & vm,
                     other=0.0).to(tl.float32)
        Vn = tl.load(vn_ptr + (pc * C + i2) * DV + vc[None, :], mask=vm, other=0.0)
        dVn = tl.load(dvn_ptr + (pc * C + i2) * DV + vc[None, :], mask=vm, other=0.0)
        Sb = tl.load(st_ptr + ((si * H + h) * DK + dkf[:, None]) * DV + vc[None, :],
                     mask=(dkf[:, None] < DK) & vm, other=0.0)
        dM = tl.dot(dO, tl.trans(Vn), dM, input_precision=PREC)
        X = vv * beta[:, None] - tl.dot(Kb, Sb, input_precision=PREC)
        dT = tl.dot(dVn, tl.trans(X), dT, input_precision=PREC)
        dVb = tl.dot(tl.trans(Tm), dVn, input_precision=PREC)
        tl.store(dv_ptr + rows[:, None] * (H * DV) + h * DV + vc[None, :], dVb * beta[:, None],
                 mask=ok[:, None] & vm)
        dbeta += tl.sum(dVb * vv, axis=1)
    dMG = tl.where(incl, dM * Gam, 0.0)
    dA = tl.dot(tl.dot(tl.trans(Tm), dT, input_precision=PREC), tl.trans(Tm), input_precision=PREC)
    dA = tl.where(strict, -dA, 0.0)
    R = dA * kk * Gam
    dbeta += tl.sum(R, axis=1)
    PA = R * beta[:, None]
    PM = dMG * qk
    dG = tl.sum(PM, axis=1) - tl.sum(PM, axis=0) + tl.sum(PA, axis=1) - tl.sum(PA, axis=0)
    D = dA * beta[:, None] * Gam
    DD = D + tl.trans(D)
    # phase 2: over Dk blocks (inner loop over Dv tiles) -> dq, dk, the rest of dg and dbeta
    sds = tl.zeros((BK,), dtype=tl.float32)
    dgl = tl.zeros((C,), dtype=tl.float32)
    for d0 in tl.static_range(0, DKP, BK):
        dc = d0 + tl.arange(0, BK)
        dm = dc[None, :] < DK
        qb = tl.load(q_ptr + rows[:, None] * s_qt + kh * s_qh + dc[None, :], mask=ok[:, None] & dm,
                     other=0.0).to(tl.float32)
        kb = tl.load(k_ptr + rows[:, None] * s_kt + kh * s_kh + dc[None, :], mask=ok[:, None] & dm,
                     other=0.0).to(tl.float32)
        nW = tl.zeros((C, BK), dtype=tl.float32)
        dQd = tl.zeros((C, BK), dtype=tl.float32)
        dKd = tl.zeros((C, BK), dtype=tl.float32)
        for v0 in tl.static_range(0, DVP, BV):
            vc = v0 + tl.arange(0, BV)
            vm = vc[None, :] < DV
            dO = tl.load(do_ptr + rows[:, None] * s_dt + h * s_dh + vc[None, :], mask=ok[:, None] & vm,
                         other=0.0).to(tl.float32)
            Vn = tl.load(vn_ptr + (pc * C + i2) * DV + vc[None, :], mask=vm, other=0.0)
            dVn = tl.load(dvn_ptr + (pc * C + i2) * DV + vc[None, :], mask=vm, other=0.0)
            sm = (dc[:, None] < DK) & vm
            Sb = tl.load(st_ptr + ((si * H + h) * DK + dc[:, None]) * DV + vc[None, :], mask=sm, other=0.0)
            dSb = tl.load(dsn_ptr + ((pc * DK) + dc[:, None]) * DV + vc[None, :], mask=sm, other=0.0)
            nW = tl.dot(dVn, tl.trans(Sb), nW, input_precision=PREC)
            dQd = tl.dot(dO, tl.trans(Sb), dQd, input_precision=PREC)
            dKd = tl.dot(Vn, tl.trans(dSb), dKd, input_precision=PREC)
            sds += tl.sum(Sb * dSb, axis=1)
        dKb = -tl.dot(tl.trans(Tm), nW, input_precision=PREC)  # T^T dW, dW = -dVn S^T
        dq = tl.dot(dMG, kb, input_precision=PREC) + dQd * eG[:, None]
        dk = tl.dot(tl.trans(dMG), qb, input_precision=PREC) + tl.dot(DD, kb, input_precision=PREC) \
            + dKd * tail[:, None] + dKb * coef[:, None]
        off = rows[:, None] * (H * DK) + h * DK + dc[None, :]
        tl.store(dq_ptr + off, dq, mask=ok[:, None] & dm)
        tl.store(dk_ptr + off, dk, mask=ok[:, None] & dm)
        kdk = tl.sum(dKd * kb, axis=1) * tail
        kbk = tl.sum(dKb * kb, axis=1)
        dG += tl.sum(dQd * qb, axis=1) * eG + kbk * coef - kdk
        dbeta += kbk * eG
        dgl += kdk
    dG += tl.where(t == C - 1, el * tl.sum(sds, axis=0) + tl.sum(dgl, axis=0), 0.0)
    dg = tl.cumsum(dG, axis=0, reverse=True)
    tl.store(dg_ptr + rows * H + h, dg, mask=ok)
    tl.store(db_ptr + rows * H + h, dbeta, mask=ok)


# --------------------------------------------------------------------------- launcher


def chunk_backward_triton(q, k, v, g, beta, cu_seqlens, do, *, chunk: int = CHUNK,
                          prec: str = BWD_DOT_PRECISION):
    """Gradients (dq [T, Hk, Dk], dk, dv [T, H, Dv], dg [T, H], dbeta [T, H], all fp32) of
    ``sum(torch_chunk_form(q, k, v, g, beta, cu_seqlens, chunk=chunk) * do)`` by the Triton
    kernels of this module. CUDA tensors, or CPU tensors under the interpreter."""
    T, Hk, Dk = k.shape
    H, Dv = v.shape[1], v.shape[2]
    rep = H // Hk
    dev = v.device
    C = chunk
    f32 = dict(dtype=torch.float32, device=dev)
    q, k, v, do = _rows3(q), _rows3(k), _rows3(v), _rows3(do)
    g, beta = g.contiguous(), beta.contiguous()
    starts, lens = _host_lens(cu_seqlens)
    row0, nrow, sidx, chunk0, nchunk, starts0, n_states = chunk_plan(starts, lens, C)
    P, B = len(row0), len(lens)
    dq_h = torch.zeros(T, H, Dk, **f32)
    dk_h = torch.zeros(T, H, Dk, **f32)
    dv = torch.zeros(T, H, Dv, **f32)
    dg = torch.zeros(T, H, **f32)
    dbeta = torch.zeros(T, H, **f32)
    if P:
        tc = bwd_tile_constants(Dk, Dv)
        row0_t, nrow_t = _i32(row0, dev), _i32(nrow, dev)
        # (a) per-chunk T, W, U, Kd, el: the forward's prep kernel, storing T too
        Tm = torch.empty(P, H, C, C, **f32)
        W, U, Kd, el = launch_prep(k, v, g, beta, row0_t, nrow_t, H, rep, C, prec=prec, t_out=Tm)
        # (b) entering states and Vn (the forward's state kernel)
        states = torch.empty(n_states, H, Dk, Dv, **f32)
        vn = torch.empty(P, H, C, Dv, **f32)
        zero = torch.zeros(1, H, Dk, Dv, **f32)
        none = _i32([-1] * B, dev)
        chunk0_t, nchunk_t = _i32(chunk0, dev), _i32(nchunk, dev)
        launch_state((W, U, Kd, el), zero, states, zero, zero, chunk0_t, nchunk_t, none,
                     _i32(starts0, dev), none, none, C, prec=prec, vnew=vn)
        del U
        # (c) dVloc = M^T dO, dSloc = Qd^T dO
        dvl = torch.empty(P, H, C, Dv, **f32)
        dsl = torch.empty(P, H, Dk, Dv, **f32)
        nvt = triton_cdiv(Dv, tc["BV"])
        _bwd_dout_kernel[(P, H, nvt)](
            q, k, g, do, row0_t, nrow_t, dvl, dsl, H, rep, Dk, Dv,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0), do.stride(0), do.stride(1),
            C=C, DKP=tc["DKP"], BK=tc["BK"], BV=tc["BV"], PREC=prec, num_warps=tc["dout_warps"])
        # (d) reverse pass: dS' and dVn per chunk
        dsn = torch.empty(P, H, Dk, Dv, **f32)
        dvn = torch.empty(P, H, C, Dv, **f32)
        _bwd_state_kernel[(B, H, nvt)](
            W, Kd, el, dvl, dsl, dsn, dvn, chunk0_t, nchunk_t, H, Dk, Dv,
            # one stage: W, Kd [C, Dk] per chunk, multi-buffered by the loop pipeliner, would
            # overflow Hopper's 227 KB of shared memory at Dk = 128 (as the forward's tf32 state
            # kernel did, see ``launch_state``)
            C=C, DKP=tc["DKP"], BV=tc["BV"], PREC=prec, num_warps=tc["state_warps"], num_stages=1)
        del W, Kd, dvl, dsl
        # (e) local gradients
        _bwd_local_kernel[(P, H)](
            q, k, v, g, beta, do, row0_t, nrow_t, _i32(sidx, dev), Tm, vn, dvn, states, dsn,
            dq_h, dk_h, dv, dg, dbeta, H, rep, Dk, Dv,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), beta.stride(0), do.stride(0), do.stride(1),
            C=C, DKP=tc["DKP"], DVP=tc["DVP"], BK=tc["BK"], BV=tc["BV"], PREC=prec,
            num_warps=tc["local_warps"])
    # GQA: value heads kh*REP .. kh*REP + REP - 1 share key head kh (one fixed-order sum)
    dq = dq_h.view(T, Hk, rep, Dk).sum(2)
    dk = dk_h.view(T, Hk, rep, Dk).sum(2)
    return dq, dk, dv, dg, dbeta


# --------------------------------------------------------------------------- reference twin


def chunk_backward_reference(q, k, v, g, beta, cu_seqlens, do, *, chunk: int = CHUNK):
    """The torch twin of :func:`chunk_backward_triton`: the same decomposition (module docstring)
    vectorised over chunks and heads, loops over chunks only for the two state passes. Returns
    (dq, dk, dv, dg, dbeta) in the computation dtype (fp32, fp64 for fp64 inputs)."""
    starts, lens, T, dt, qc, kc, vc, gc, bc = _prepare(q, k, v, g, beta, cu_seqlens, chunk)
    B, H, W_, Dk = kc.shape
    Dv = vc.shape[-1]
    Hk = k.shape[1]
    rep = H // Hk
    C = chunk
    nc = W_ // C
    dev = v.device
    dop = _pad_seqs(do.to(dt), starts, lens, W_).transpose(1, 2)
    qc, kc, vc, doc = (x.reshape(B, H, nc, C, -1) for x in (qc, kc, vc, dop))
    gc, bc = gc.reshape(B, H, nc, C), bc.reshape(B, H, nc, C)
    tr = lambda x: x.transpose(-1, -2)  # noqa: E731
    # forward recompute (per chunk, all chunks at once)
    G = gc.cumsum(-1)
    eG = G.exp()
    g_last = G[..., -1]
    el = g_last.exp()
    tail = (g_last[..., None] - G).exp()
    coef = bc * eG
    idx = torch.arange(C, device=dev)
    incl = idx[None, :] <= idx[:, None]
    strict = idx[None, :] < idx[:, None]
    dGm = G[..., :, None] - G[..., None, :]
    Gam = torch.where(incl, torch.where(incl, dGm, torch.zeros_like(dGm)).exp(), torch.zeros_like(dGm))
    qk = qc @ tr(kc)
    kk = kc @ tr(kc)
    A = torch.where(strict, bc[..., :, None] * kk * Gam, torch.zeros_like(kk))
    eye = torch.eye(C, dtype=dt, device=dev)
    Tm = torch.linalg.solve_triangular(A + eye, eye.expand_as(A), upper=False, unitriangular=True)
    Vb = vc * bc[..., None]
    Kb = kc * coef[..., None]
    U, W = Tm @ Vb, Tm @ Kb
    Kd = kc * tail[..., None]
    Qd = qc * eG[..., None]
    M = torch.where(incl, qk * Gam, torch.zeros_like(qk))
    # (b) entering states and Vn, sequential over chunks
    S = torch.zeros(B, H, Dk, Dv, dtype=dt, device=dev)
    states, vns = [], []
    for c in range(nc):
        states.append(S)
        vn = U[:, :, c] - W[:, :, c] @ S
        vns.append(vn)
        S = S * el[:, :, c, None, None] + tr(Kd[:, :, c]) @ vn
    St = torch.stack(states, dim=2)
    Vn = torch.stack(vns, dim=2)
    # (c) state-independent parts of the reverse pass
    dVloc = tr(M) @ doc
    dSloc = tr(Qd) @ doc
    # (d) reverse pass
    dS = torch.zeros(B, H, Dk, Dv, dtype=dt, device=dev)
    dsn, dvn = [None] * nc, [None] * nc
    for c in reversed(range(nc)):
        dsn[c] = dS
        dvn[c] = dVloc[:, :, c] + Kd[:, :, c] @ dS
        dS = dS * el[:, :, c, None, None] + dSloc[:, :, c] - tr(W[:, :, c]) @ dvn[c]
    dSn = torch.stack(dsn, dim=2)
    dVn = torch.stack(dvn, dim=2)
    # (e) local gradients
    dM = doc @ tr(Vn)
    dT = dVn @ tr(Vb - Kb @ St)
    dVb = tr(Tm) @ dVn
    dv = dVb * bc[..., None]
    dbeta = (dVb * vc).sum(-1)
    dMG = torch.where(incl, dM * Gam, torch.zeros_like(dM))
    dA = torch.where(strict, -(tr(Tm) @ dT @ tr(Tm)), torch.zeros_like(dT))
    R = dA * kk * Gam
    dbeta = dbeta + R.sum(-1)
    PA = R * bc[..., :, None]
    PM = dMG * qk
    dG = PM.sum(-1) - PM.sum(-2) + PA.sum(-1) - PA.sum(-2)
    D = dA * bc[..., :, None] * Gam
    DD = D + tr(D)
    dW = -(dVn @ tr(St))
    dQd = doc @ tr(St)
    dKd = Vn @ tr(dSn)
    dKb = tr(Tm) @ dW
    dq = dMG @ kc + dQd * eG[..., None]
    dk = tr(dMG) @ qc + DD @ kc + dKd * tail[..., None] + dKb * coef[..., None]
    kdk = (dKd * kc).sum(-1) * tail
    kbk = (dKb * kc).sum(-1)
    dG = dG + (dQd * qc).sum(-1) * eG + kbk * coef - kdk
    dbeta = dbeta + kbk * eG
    dgl = el * (St * dSn).sum((-1, -2)) + kdk.sum(-1)
    dG = torch.cat([dG[..., :-1], (dG[..., -1] + dgl)[..., None]], dim=-1)
    dg = dG.flip(-1).cumsum(-1).flip(-1)

    def unpad(x):  # [B, H, nc, C, ...] -> [T, H, ...]
        x = x.reshape(B, H, W_, *x.shape[4:]).transpose(1, 2)
        return _unpad_seqs(x, starts, lens, T)

    dq = unpad(dq).view(T, Hk, rep, Dk).sum(2)
    dk = unpad(dk).view(T, Hk, rep, Dk).sum(2)
    return dq, dk, unpad(dv), unpad(dg), unpad(dbeta)
