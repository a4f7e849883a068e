"""Backward of the native WY chunk forward (``native_wy.py``): the trainer gradient of the native
chunk path on CUDA (``native.NATIVE_BWD_KIND = "wy"``), in the form stock backward kernels take.

A baseline like its forward: correct at a stated tolerance and deterministic (fixed reduction
orders, no atomics: the same inputs give the same bits), not batch invariant. CPR's trainer and the
recurrent-everywhere trainer keep the shared backward of ``chunk_backward.py`` (tf32x3, fp32).

The gradient is the one ``chunk_backward.py``'s docstring derives (same notation: per chunk and
value head, S the state entering the chunk, dS' the gradient reaching the state leaving it, zero
after a sequence's last chunk)::

    dVloc = M^T dO                                   M = causal(q k^T * Gam), Gam_ij = e^(G_i - G_j)
    dVn   = dVloc + Kd dS'                           Kd = k e^(Gl - G)     (reverse pass, in order)
    dS    = e^Gl dS' + (q e^G)^T dO - W^T dVn        (the dS' of the previous chunk)
    dM = dO Vn^T,  dMG = dM * Gam,  dQd = dO S^T,  dKd = Vn dS'^T,  dW = -dVn S^T
    dq    = dMG k + dQd e^G
    dk    = dMG^T q + dKd e^(Gl - G) + dKb beta e^G + (D + D^T) k
    dT    = dVn (v beta)^T + dW (k beta e^G)^T,  dA = strict_lower(-T^T dT T^T),  D = dA beta Gam
    dVb   = T^T dVn,  dKb = T^T dW,  dv = dVb beta
    dbeta = rowsum(dVb v) + rowsum(dKb k) e^G + rowsum(dA * KK * Gam)
    dG    = rowsum(P_M) - colsum(P_M) + rowsum(P_A) - colsum(P_A) + rowsum(dQd q) e^G
            + rowsum(dKb k) beta e^G - rowsum(dKd k) e^(Gl - G),   P_M = dMG * q k^T, P_A = dA * A
            + (e^Gl sum(S * dS') + sum(dKd * Kd)) at the chunk's last valid row
    dg    = reverse cumulative sum of dG within the chunk

Kernels (chunks cut from each sequence's first token, one launch each):
  forward recompute  ``native_wy.wy_forward_parts`` (G, T, W, k's operand copy, entering states
                      and Vn: the forward's first three kernels)
  ``_wyb_dvloc_kernel`` per (Dv tile, value head, chunk): dVloc
  ``_wyb_dhu_kernel``   per (sequence, value head, Dv tile): the reverse pass over the chunks,
                        storing dS' and dVn of every chunk
  ``_wyb_dqk_kernel``   per (value head, chunk): dq, the dM / dKd part of dk, dW, and the dM /
                        dQd / dKd / Gl part of dG
  ``_wyb_wy_kernel``    per (value head, chunk): dT, dA, dv, dbeta, the rest of dk and dG, and
                        dg by a reverse cumsum
  then GQA: the REP value heads' dq, dk summed per key head (one ``torch.sum``, fixed order).

Rounding schedule: the forward's (``NativeWYChoice.dot``). "bf16" (bf16 values): every large dot
takes bf16 operands (q, k, v, dO, T, W, the states, dS', Vn, dVn, dVloc, dW, and the [C, C]
tiles M, dMG, dT, D + D^T, T^T dT rounded to nearest even) with fp32 accumulation, and dVloc, dS',
dVn, dW are stored in bf16 (each feeds dots; dVloc also one addition), as stock backward kernels
do; the gradients, dG, the decays and the carried dS stay fp32. "tf32" / "tf32x3" / "ieee": fp32
operands at that precision, fp32 storage. Reductions: dots over Dk or Dv in blocks of the choice's
``bk`` / ``state_bv`` accumulated in order, ``tl.sum`` / ``tl.cumsum`` over register tiles, the dS
chain in chunk order; no atomics.

Torch twin: :func:`wy_chunk_backward_torch` (the same steps and rounding points, padded layout).

Tested in the CPU interpreter, compiled for sm_90 by ``scripts/native_wy_aot.py``, and on the H200
(``results/h200/PROVENANCE.md``): against float64 autograd, two calls bitwise (after
``WYB_KK_MODE`` 2), the hybrid model's backward-determinism gate at Qwen3.5-9B layer dimensions.
"""

from __future__ import annotations

import torch

from .._triton_util import jit, tl
from . import native_wy as nwy
from .padding import _pad_seqs, _prepare, _unpad_seqs
from .plan import _host_lens
from .state import CHUNK


WYB_KK_MODE = 2
"""How ``_wyb_wy_kernel`` forms k k^T: 0 as a dot of one loaded tile with its own transpose inside
the dT loop; 1 the same loop with the transposed operand loaded a second time; 2 in a loop of its
own, both operands loaded separately. On the H200 (Triton 3.6) modes 0 and 1 gave k k^T, and so
dg and dbeta, that differed between two launches on the same inputs (every other gradient equal;
no read of unwritten memory); mode 2 gave the same bits every time.
``scripts/wy_bwd_determinism_probe.py`` replays the kernel in each mode (its ``DBG`` stores the
intermediates), so the question can be asked again of another Triton. Modes 0 and 1 and ``DBG``
stay for that probe only; removing them changes the compiled kernel (246 -> 228 registers by
``scripts/native_wy_aot.py``), which then needs the GPU determinism test again."""


# --------------------------------------------------------------------------- Triton kernels


@jit
def _wyb_dvloc_kernel(
    q_ptr, k_ptr, gc_ptr, do_ptr, row0_ptr, nrow_ptr, dvl_ptr,
    H, REP, DK, DV, s_qt, s_qh, s_kt, s_kh, s_dt, s_dh,
    C: tl.constexpr, DKP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    OP_DT: tl.constexpr, DOT_DT: tl.constexpr, PREC: tl.constexpr,
):
    # One program per (Dv tile, value head h, chunk p): dVloc = M^T dO (stored [P, H, C, DV]).
    vt = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2)
    n = tl.load(nrow_ptr + p)
    r0 = tl.load(row0_ptr + p).to(tl.int64)
    pc = p.to(tl.int64) * H + h
    kh = h // REP
    qb = q_ptr + r0 * s_qt + kh * s_qh
    kb = k_ptr + r0 * s_kt + kh * s_kh
    t = tl.arange(0, C)
    ok = t < n
    dv = vt * BV + tl.arange(0, BV)
    vm = dv[None, :] < DV
    qk = tl.zeros((C, C), dtype=tl.float32)
    for d0 in range(0, DKP, BK):
        dc = d0 + tl.arange(0, BK)
        dm = dc[None, :] < DK
        Q = tl.load(qb + t[:, None] * s_qt + dc[None, :], mask=ok[:, None] & dm, other=0.0).to(OP_DT).to(DOT_DT)
        K = tl.load(kb + t[:, None] * s_kt + dc[None, :], mask=ok[:, None] & dm, other=0.0).to(OP_DT).to(DOT_DT)
        qk = tl.dot(Q, tl.trans(K), qk, input_precision=PREC)
    G = tl.load(gc_ptr + r0 * H + h + t * H, mask=ok, other=0.0)
    incl = (t[None, :] <= t[:, None]) & ok[:, None]
    M = tl.where(incl, qk * tl.exp(tl.where(incl, G[:, None] - G[None, :], 0.0)), 0.0)
    dO = tl.load(do_ptr + r0 * s_dt + h * s_dh + t[:, None] * s_dt + dv[None, :], mask=ok[:, None] & vm,
                 other=0.0).to(OP_DT).to(DOT_DT)
    dvl = tl.dot(tl.trans(M.to(OP_DT).to(DOT_DT)), dO, input_precision=PREC)
    tl.store(dvl_ptr + pc * (C * DV) + t[:, None] * DV + dv[None, :], dvl.to(dvl_ptr.dtype.element_ty), mask=vm)


@jit
def _wyb_dhu_kernel(
    q_ptr, k_ptr, gc_ptr, w_ptr, do_ptr, dvl_ptr, row0_ptr, nrow_ptr, chunk0_ptr, nchunk_ptr, dsn_ptr, dvn_ptr,
    H, REP, DK, DV, s_qt, s_qh, s_kt, s_kh, s_dt, s_dh,
    C: tl.constexpr, DKP: tl.constexpr, BV: tl.constexpr,
    OP_DT: tl.constexpr, DOT_DT: tl.constexpr, PREC: tl.constexpr,
):
    # One program per (sequence p, value head h, Dv tile): dS = 0 after the last chunk; for the
    # chunks last to first: dsn[chunk] = dS; dVn = dVloc + (k dS) e^(Gl - G) (stored);
    # dS = e^Gl dS + (q e^G)^T dO - W^T dVn.
    p = tl.program_id(0)
    h = tl.program_id(1)
    vt = tl.program_id(2)
    n = tl.load(nchunk_ptr + p)
    c0 = tl.load(chunk0_ptr + p)
    kh = h // REP
    dk = tl.arange(0, DKP)
    dv = vt * BV + tl.arange(0, BV)
    t = tl.arange(0, C)
    km = dk < DK
    vm = dv < DV
    soff = dk[:, None] * DV + dv[None, :]
    dS = tl.zeros((DKP, BV), dtype=tl.float32)
    for i in range(0, n):
        q = c0 + (n - 1 - i)
        r0 = tl.load(row0_ptr + q).to(tl.int64)
        nr = tl.load(nrow_ptr + q)
        ok = t < nr
        pc = q.to(tl.int64) * H + h
        tl.store(dsn_ptr + pc * (DK * DV) + soff, dS.to(dsn_ptr.dtype.element_ty), mask=km[:, None] & vm[None, :])
        cb = gc_ptr + r0 * H + h
        G = tl.load(cb + t * H, mask=ok, other=0.0)
        gl = tl.load(cb + (nr - 1) * H)
        K = tl.load(k_ptr + r0 * s_kt + kh * s_kh + t[:, None] * s_kt + dk[None, :], mask=ok[:, None] & km[None, :],
                    other=0.0)
        vrow = pc * (C * DV) + t[:, None] * DV + dv[None, :]
        dVn = tl.load(dvl_ptr + vrow, mask=vm[None, :], other=0.0).to(tl.float32) \
            + tl.dot(K.to(OP_DT).to(DOT_DT), dS.to(OP_DT).to(DOT_DT), input_precision=PREC) \
            * tl.where(ok, tl.exp(gl - G), 0.0)[:, None]
        tl.store(dvn_ptr + vrow, dVn.to(dvn_ptr.dtype.element_ty), mask=vm[None, :])
        Qs = tl.load(q_ptr + r0 * s_qt + kh * s_qh + t[:, None] * s_qt + dk[None, :], mask=ok[:, None] & km[None, :],
                     other=0.0).to(tl.float32) * tl.exp(G)[:, None]
        dO = tl.load(do_ptr + r0 * s_dt + h * s_dh + t[:, None] * s_dt + dv[None, :], mask=ok[:, None] & vm[None, :],
                     other=0.0)
        W = tl.load(w_ptr + pc * (C * DK) + t[:, None] * DK + dk[None, :], mask=km[None, :], other=0.0)
        dS = tl.dot(tl.trans(Qs.to(OP_DT).to(DOT_DT)), dO.to(OP_DT).to(DOT_DT), dS * tl.exp(gl), input_precision=PREC)
        dS = dS - tl.dot(tl.trans(W.to(OP_DT).to(DOT_DT)), dVn.to(OP_DT).to(DOT_DT), input_precision=PREC)


@jit
def _wyb_dqk_kernel(
    q_ptr, k_ptr, gc_ptr, st_ptr, dsn_ptr, vn_ptr, dvn_ptr, do_ptr, row0_ptr, nrow_ptr,
    dq_ptr, dk_ptr, dw_ptr, dg_ptr,
    H, REP, DK, DV, s_qt, s_qh, s_kt, s_kh, s_dt, s_dh,
    C: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    OP_DT: tl.constexpr, DOT_DT: tl.constexpr, PREC: tl.constexpr,
):
    # One program per (value head h, chunk p): dq (final, per value head), the first part of dk
    # (dMG^T q + dKd e^(Gl - G)), dW = -dVn S^T (stored), and the first part of dG [T, H].
    h = tl.program_id(0)
    p = tl.program_id(1)
    n = tl.load(nrow_ptr + p)
    r0 = tl.load(row0_ptr + p).to(tl.int64)
    pc = p.to(tl.int64) * H + h
    kh = h // REP
    qb = q_ptr + r0 * s_qt + kh * s_qh
    kb = k_ptr + r0 * s_kt + kh * s_kh
    db = do_ptr + r0 * s_dt + h * s_dh
    t = tl.arange(0, C)
    ok = t < n
    G = tl.load(gc_ptr + r0 * H + h + t * H, mask=ok, other=0.0)
    gl = tl.load(gc_ptr + r0 * H + h + (n - 1) * H)
    eG = tl.exp(G)
    tail = tl.where(ok, tl.exp(gl - G), 0.0)
    incl = (t[None, :] <= t[:, None]) & ok[:, None]
    Gam = tl.where(incl, tl.exp(tl.where(incl, G[:, None] - G[None, :], 0.0)), 0.0)
    # q k^T over Dk, dM = dO Vn^T over Dv
    qk = tl.zeros((C, C), dtype=tl.float32)
    for d0 in range(0, DKP, BK):
        dc = d0 + tl.arange(0, BK)
        dm = ok[:, None] & (dc[None, :] < DK)
        Q = tl.load(qb + t[:, None] * s_qt + dc[None, :], mask=dm, other=0.0).to(OP_DT).to(DOT_DT)
        K = tl.load(kb + t[:, None] * s_kt + dc[None, :], mask=dm, other=0.0).to(OP_DT).to(DOT_DT)
        qk = tl.dot(Q, tl.trans(K), qk, input_precision=PREC)
    dM = tl.zeros((C, C), dtype=tl.float32)
    for v0 in range(0, DVP, BV):
        vc = v0 + tl.arange(0, BV)
        vm = vc[None, :] < DV
        dO = tl.load(db + t[:, None] * s_dt + vc[None, :], mask=ok[:, None] & vm, other=0.0).to(OP_DT).to(DOT_DT)
        Vn = tl.load(vn_ptr + pc * (C * DV) + t[:, None] * DV + vc[None, :], mask=vm, other=0.0).to(OP_DT).to(DOT_DT)
        dM = tl.dot(dO, tl.trans(Vn), dM, input_precision=PREC)
    dMG = dM * Gam
    PM = dMG * qk
    dG = tl.sum(PM, axis=1) - tl.sum(PM, axis=0)
    dMGo = dMG.to(OP_DT).to(DOT_DT)
    sds = tl.zeros((BK,), dtype=tl.float32)
    kdk = tl.zeros((C,), dtype=tl.float32)
    for d0 in tl.static_range(0, DKP, BK):
        dc = d0 + tl.arange(0, BK)
        dm = dc[None, :] < DK
        dQd = tl.zeros((C, BK), dtype=tl.float32)
        dKd = tl.zeros((C, BK), dtype=tl.float32)
        nW = tl.zeros((C, BK), dtype=tl.float32)
        for v0 in range(0, DVP, BV):
            vc = v0 + tl.arange(0, BV)
            vm = vc[None, :] < DV
            sm = (dc[:, None] < DK) & vm
            soff = pc * (DK * DV) + dc[:, None] * DV + vc[None, :]
            Sb = tl.load(st_ptr + soff, mask=sm, other=0.0)
            dSb = tl.load(dsn_ptr + soff, mask=sm, other=0.0)
            dO = tl.load(db + t[:, None] * s_dt + vc[None, :], mask=ok[:, None] & vm, other=0.0).to(OP_DT).to(DOT_DT)
            voff = pc * (C * DV) + t[:, None] * DV + vc[None, :]
            Vn = tl.load(vn_ptr + voff, mask=vm, other=0.0).to(OP_DT).to(DOT_DT)
            dVn = tl.load(dvn_ptr + voff, mask=vm, other=0.0).to(OP_DT).to(DOT_DT)
            Sbo = tl.trans(Sb.to(OP_DT).to(DOT_DT))
            dQd = tl.dot(dO, Sbo, dQd, input_precision=PREC)
            nW = tl.dot(dVn, Sbo, nW, input_precision=PREC)
            dKd = tl.dot(Vn, tl.trans(dSb.to(OP_DT).to(DOT_DT)), dKd, input_precision=PREC)
            sds += tl.sum(Sb.to(tl.float32) * dSb.to(tl.float32), axis=1)
        Q = tl.load(qb + t[:, None] * s_qt + dc[None, :], mask=ok[:, None] & dm, other=0.0).to(tl.float32)
        K = tl.load(kb + t[:, None] * s_kt + dc[None, :], mask=ok[:, None] & dm, other=0.0).to(tl.float32)
        dq = tl.dot(dMGo, K.to(OP_DT).to(DOT_DT), input_precision=PREC) + dQd * eG[:, None]
        dk = tl.dot(tl.trans(dMGo), Q.to(OP_DT).to(DOT_DT), input_precision=PREC) + dKd * tail[:, None]
        off = (r0 + t[:, None]) * (H * DK) + h * DK + dc[None, :]
        tl.store(dq_ptr + off, dq, mask=ok[:, None] & dm)
        tl.store(dk_ptr + off, dk, mask=ok[:, None] & dm)
        tl.store(dw_ptr + pc * (C * DK) + t[:, None] * DK + dc[None, :], (-nW).to(dw_ptr.dtype.element_ty), mask=dm)
        kd = tl.sum(dKd * K, axis=1) * tail
        dG += tl.sum(dQd * Q, axis=1) * eG - kd
        kdk += kd
    dG += tl.where(t == n - 1, tl.exp(gl) * tl.sum(sds, axis=0) + tl.sum(kdk, axis=0), 0.0)
    tl.store(dg_ptr + (r0 + t) * H + h, dG, mask=ok)


@jit
def _wyb_wy_kernel(
    k_ptr, v_ptr, b_ptr, gc_ptr, t_ptr, dw_ptr, dvn_ptr, row0_ptr, nrow_ptr,
    dk_ptr, dg_ptr, dv_ptr, db_ptr, dbg_ptr,
    H, REP, DK, DV, s_kt, s_kh, s_vt, s_vh, s_bt,
    C: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    OP_DT: tl.constexpr, DOT_DT: tl.constexpr, PREC: tl.constexpr, KK_MODE: tl.constexpr = 0,
    DBG: tl.constexpr = False,
):
    # One program per (value head h, chunk p): through the WY representation. Reads dW, dU = dVn,
    # the dk and dG parts of ``_wyb_dqk_kernel``; writes dv, dbeta, dk (completed), dg.
    h = tl.program_id(0)
    p = tl.program_id(1)
    n = tl.load(nrow_ptr + p)
    r0 = tl.load(row0_ptr + p).to(tl.int64)
    pc = p.to(tl.int64) * H + h
    kb = k_ptr + r0 * s_kt + (h // REP) * s_kh
    vb = v_ptr + r0 * s_vt + h * s_vh
    t = tl.arange(0, C)
    ok = t < n
    G = tl.load(gc_ptr + r0 * H + h + t * H, mask=ok, other=0.0)
    beta = tl.load(b_ptr + r0 * s_bt + h + t * s_bt, mask=ok, other=0.0).to(tl.float32)
    eG = tl.exp(G)
    coef = beta * eG
    strict = (t[None, :] < t[:, None]) & ok[:, None]
    Tm = tl.load(t_ptr + pc * (C * C) + t[:, None] * C + t[None, :]).to(OP_DT).to(DOT_DT)
    TmT = tl.trans(Tm)
    dT = tl.zeros((C, C), dtype=tl.float32)
    dbeta = tl.zeros((C,), dtype=tl.float32)
    # dU = dVn: dT += dVn (v beta)^T, dv = (T^T dVn) beta
    for v0 in range(0, DVP, BV):
        vc = v0 + tl.arange(0, BV)
        vm = vc[None, :] < DV
        dVn = tl.load(dvn_ptr + pc * (C * DV) + t[:, None] * DV + vc[None, :], mask=vm, other=0.0).to(OP_DT).to(DOT_DT)
        V = tl.load(vb + t[:, None] * s_vt + vc[None, :], mask=ok[:, None] & vm, other=0.0).to(tl.float32)
        dT = tl.dot(dVn, tl.trans((V * beta[:, None]).to(OP_DT).to(DOT_DT)), dT, input_precision=PREC)
        dVb = tl.dot(TmT, dVn, input_precision=PREC)
        tl.store(dv_ptr + (r0 + t[:, None]) * (H * DV) + h * DV + vc[None, :], dVb * beta[:, None],
                 mask=ok[:, None] & vm)
        dbeta += tl.sum(dVb * V, axis=1)
    # dW: dT += dW (k beta e^G)^T; k k^T
    kk = tl.zeros((C, C), dtype=tl.float32)
    if KK_MODE == 2:
        for d0 in range(0, DKP, BK):
            dc = d0 + tl.arange(0, BK)
            dm = dc[None, :] < DK
            Ka = tl.load(kb + t[:, None] * s_kt + dc[None, :], mask=ok[:, None] & dm, other=0.0).to(OP_DT).to(DOT_DT)
            Kb = tl.load(kb + t[:, None] * s_kt + dc[None, :], mask=ok[:, None] & dm, other=0.0).to(OP_DT).to(DOT_DT)
            kk = tl.dot(Ka, tl.trans(Kb), kk, input_precision=PREC)
    for d0 in range(0, DKP, BK):
        dc = d0 + tl.arange(0, BK)
        dm = dc[None, :] < DK
        K = tl.load(kb + t[:, None] * s_kt + dc[None, :], mask=ok[:, None] & dm, other=0.0).to(tl.float32)
        dW = tl.load(dw_ptr + pc * (C * DK) + t[:, None] * DK + dc[None, :], mask=dm, other=0.0).to(OP_DT).to(DOT_DT)
        dT = tl.dot(dW, tl.trans((K * coef[:, None]).to(OP_DT).to(DOT_DT)), dT, input_precision=PREC)
        if KK_MODE == 0:
            Ko = K.to(OP_DT).to(DOT_DT)
            kk = tl.dot(Ko, tl.trans(Ko), kk, input_precision=PREC)
        elif KK_MODE == 1:
            Kb = tl.load(kb + t[:, None] * s_kt + dc[None, :], mask=ok[:, None] & dm, other=0.0).to(OP_DT).to(DOT_DT)
            kk = tl.dot(K.to(OP_DT).to(DOT_DT), tl.trans(Kb), kk, input_precision=PREC)
    # dA = strict_lower(-T^T dT T^T); through A = beta KK Gam
    X = tl.dot(TmT, dT.to(OP_DT).to(DOT_DT), input_precision=PREC)
    dA = tl.where(strict, -tl.dot(X.to(OP_DT).to(DOT_DT), TmT, input_precision=PREC), 0.0)
    Gam = tl.where(strict, tl.exp(tl.where(strict, G[:, None] - G[None, :], 0.0)), 0.0)
    R = dA * kk * Gam
    if DBG:   # intermediates for scripts/wy_bwd_determinism_probe.py: [P, H, 5, C, C] fp32
        cc = t[:, None] * C + t[None, :]
        tl.store(dbg_ptr + pc * (5 * C * C) + cc, kk)
        tl.store(dbg_ptr + pc * (5 * C * C) + C * C + cc, dT)
        tl.store(dbg_ptr + pc * (5 * C * C) + 2 * C * C + cc, dA)
        tl.store(dbg_ptr + pc * (5 * C * C) + 3 * C * C + cc, R)
        tl.store(dbg_ptr + pc * (5 * C * C) + 4 * C * C + t, dbeta)
    dbeta += tl.sum(R, axis=1)
    PA = R * beta[:, None]
    dG = tl.load(dg_ptr + (r0 + t) * H + h, mask=ok, other=0.0) + tl.sum(PA, axis=1) - tl.sum(PA, axis=0)
    if DBG:
        tl.store(dbg_ptr + pc * (5 * C * C) + 4 * C * C + C + t, dG)
        tl.store(dbg_ptr + pc * (5 * C * C) + 4 * C * C + 2 * C + t, dbeta)
    D = dA * beta[:, None] * Gam
    DD = (D + tl.trans(D)).to(OP_DT).to(DOT_DT)
    # dk += dKb beta e^G + (D + D^T) k, dKb = T^T dW
    for d0 in range(0, DKP, BK):
        dc = d0 + tl.arange(0, BK)
        dm = dc[None, :] < DK
        K = tl.load(kb + t[:, None] * s_kt + dc[None, :], mask=ok[:, None] & dm, other=0.0).to(tl.float32)
        dW = tl.load(dw_ptr + pc * (C * DK) + t[:, None] * DK + dc[None, :], mask=dm, other=0.0).to(OP_DT).to(DOT_DT)
        dKb = tl.dot(TmT, dW, input_precision=PREC)
        off = (r0 + t[:, None]) * (H * DK) + h * DK + dc[None, :]
        dk = tl.load(dk_ptr + off, mask=ok[:, None] & dm, other=0.0) + dKb * coef[:, None] \
            + tl.dot(DD, K.to(OP_DT).to(DOT_DT), input_precision=PREC)
        tl.store(dk_ptr + off, dk, mask=ok[:, None] & dm)
        kbk = tl.sum(dKb * K, axis=1)
        dG += kbk * coef
        dbeta += kbk * eG
    if DBG:
        tl.store(dbg_ptr + pc * (5 * C * C) + 4 * C * C + 3 * C + t, dG)
        tl.store(dbg_ptr + pc * (5 * C * C) + 4 * C * C + 4 * C + t, dbeta)
    dg = tl.cumsum(dG, axis=0, reverse=True)
    tl.store(dg_ptr + (r0 + t) * H + h, dg, mask=ok)
    tl.store(db_ptr + (r0 + t) * H + h, dbeta, mask=ok)


# --------------------------------------------------------------------------- launcher


def wy_chunk_backward_triton(q, k, v, g, beta, cu_seqlens, do, *, chunk: int = CHUNK,
                             choice: nwy.NativeWYChoice | None = None):
    """Gradients (dq [T, Hk, Dk], dk, dv [T, H, Dv], dg [T, H], dbeta [T, H], all fp32) of
    ``sum(o * do)`` for the native WY forward's function (trainer: every sequence from the zero
    state). CUDA tensors, or CPU tensors under the interpreter."""
    T, Hk, Dk = k.shape
    H, Dv = v.shape[1], v.shape[2]
    rep = H // Hk
    dev = v.device
    C = chunk
    f32 = dict(dtype=torch.float32, device=dev)
    q, do = nwy._rows3(q), nwy._rows3(do)
    starts, lens = _host_lens(cu_seqlens)
    B = len(lens)
    f = nwy.wy_forward_parts(q, k, v, g, beta, starts, lens, None, None, [-1] * B, C, choice)
    # every row belongs to exactly one chunk and the kernels write all of them: no zero fill
    new = torch.zeros if f is None else torch.empty
    dq_h = new(T, H, Dk, **f32)
    dk_h = new(T, H, Dk, **f32)
    dv = new(T, H, Dv, **f32)
    dg = new(T, H, **f32)
    dbeta = new(T, H, **f32)
    if f is not None:
        choice, dm, P, st = f.choice, f.dims, f.P, f.st_dt
        DKP, DVP, BK = dm["DKP"], dm["DVP"], dm["BK"]
        BV = nwy.state_tile(choice, st, DVP)
        kc = f.kc
        v, beta = nwy._rows3(v), beta.contiguous()
        strides = (q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), do.stride(0), do.stride(1))
        dvl = torch.empty(P, H, C, Dv, dtype=st, device=dev)
        obv = min(choice.out_bv, DVP)
        _wyb_dvloc_kernel[(-(-Dv // obv), H, P)](
            q, kc, f.gc, do, f.row0, f.nrow, dvl, H, rep, Dk, Dv, *strides,
            C=C, DKP=DKP, BK=BK, BV=obv, **f.num, num_warps=choice.out_warps, num_stages=choice.out_stages)
        dsn = torch.empty(P, H, Dk, Dv, dtype=st, device=dev)
        dvn = torch.empty(P, H, C, Dv, dtype=st, device=dev)
        _wyb_dhu_kernel[(B, H, -(-Dv // BV))](
            q, kc, f.gc, f.W, do, dvl, f.row0, f.nrow, f.chunk0, f.nchunk, dsn, dvn, H, rep, Dk, Dv, *strides,
            C=C, DKP=DKP, BV=BV, **f.num, num_warps=choice.dhu_warps, num_stages=choice.dhu_stages)
        del dvl
        dw = torch.empty(P, H, C, Dk, dtype=st, device=dev)
        _wyb_dqk_kernel[(H, P)](
            q, kc, f.gc, f.states, dsn, f.vn, dvn, do, f.row0, f.nrow, dq_h, dk_h, dw, dg, H, rep, Dk, Dv, *strides,
            C=C, DKP=DKP, DVP=DVP, BK=BK, BV=BK, **f.num, num_warps=choice.dqk_warps,
            num_stages=choice.bwd_stages)
        del dsn
        _wyb_wy_kernel[(H, P)](
            kc, v, beta, f.gc, f.T, dw, dvn, f.row0, f.nrow, dk_h, dg, dv, dbeta, dbeta, H, rep, Dk, Dv,
            kc.stride(0), kc.stride(1), v.stride(0), v.stride(1), beta.stride(0),
            C=C, DKP=DKP, DVP=DVP, BK=BK, BV=BK, **f.num, KK_MODE=WYB_KK_MODE, num_warps=choice.wyb_warps,
            num_stages=choice.bwd_stages)
    # GQA: value heads kh*REP .. kh*REP + REP - 1 share key head kh (one fixed-order sum)
    dq = dq_h.view(T, Hk, rep, Dk).sum(2)
    dk = dk_h.view(T, Hk, rep, Dk).sum(2)
    return dq, dk, dv, dg, dbeta


# --------------------------------------------------------------------------- torch twin


def wy_chunk_backward_torch(q, k, v, g, beta, cu_seqlens, do, *, chunk: int = CHUNK, dot: str = "tf32"):
    """Torch twin of :func:`wy_chunk_backward_triton`: the same steps with the same rounding
    points (``dot`` "bf16" rounds the operands and the bf16-stored intermediates through
    ``native_wy.round_bf16``; anything else computes in fp32, float64 for float64 inputs), padded
    [B, H, chunks, C, ...] layout. Returns (dq, dk, dv, dg, dbeta)."""
    starts, lens, T, dt, qp, kp, vp, gp, bp = _prepare(q, k, v, g, beta, cu_seqlens, chunk)
    B, H, W_, Dk = kp.shape
    Dv = vp.shape[-1]
    Hk = k.shape[1]
    rep = H // Hk
    C = chunk
    nc = W_ // C
    dev = v.device
    r = nwy.round_bf16 if dot == "bf16" else (lambda x: x)
    tr = lambda x: x.transpose(-1, -2)  # noqa: E731
    dop = _pad_seqs(do.to(dt), starts, lens, W_).transpose(1, 2)
    qc, kc, vc, doc = (x.reshape(B, H, nc, C, -1) for x in (qp, kp, vp, dop))
    gc, bc = gp.reshape(B, H, nc, C), bp.reshape(B, H, nc, C)
    # forward recompute, as the forward's twin rounds it
    G = gc.cumsum(-1)
    eG = G.exp()
    g_last = G[..., -1]
    el = g_last.exp()
    tail = (g_last[..., None] - G).exp()
    coef = bc * eG
    idx = torch.arange(C, device=dev)
    incl = idx[None, :] <= idx[:, None]
    strict = idx[None, :] < idx[:, None]
    zero = torch.zeros((), dtype=dt, device=dev)
    dGm = G[..., :, None] - G[..., None, :]
    Gam = torch.where(incl, torch.where(incl, dGm, zero).exp(), zero)
    kk = r(kc) @ tr(r(kc))
    A = torch.where(strict, bc[..., :, None] * kk * Gam, zero)
    Tm = r(nwy.blocked_unit_lower_inverse(A))
    Wk = r(Tm @ r(kc * coef[..., None]))
    U = r(Tm @ r(vc * bc[..., None]))
    S = torch.zeros(B, H, Dk, Dv, dtype=dt, device=dev)
    states, vns = [], []
    for c in range(nc):
        Sr = r(S)
        states.append(Sr)
        vn = U[:, :, c] - Wk[:, :, c] @ Sr
        vns.append(r(vn))
        S = S * el[:, :, c, None, None] + tr(r(kc[:, :, c])) @ r(vn * tail[:, :, c, :, None])
    St = torch.stack(states, dim=2)
    Vn = torch.stack(vns, dim=2)
    qk = r(qc) @ tr(r(kc))
    M = torch.where(incl, qk * Gam, zero)
    # dVloc, then the reverse pass
    dVloc = r(tr(r(M)) @ r(doc))
    dS = torch.zeros(B, H, Dk, Dv, dtype=dt, device=dev)
    dsn, dvn = [None] * nc, [None] * nc
    for c in reversed(range(nc)):
        dsn[c] = r(dS)
        d = dVloc[:, :, c] + (r(kc[:, :, c]) @ r(dS)) * tail[:, :, c, :, None]
        dvn[c] = r(d)
        dS = dS * el[:, :, c, None, None] + tr(r(qc[:, :, c] * eG[:, :, c, :, None])) @ r(doc[:, :, c]) \
            - tr(Wk[:, :, c]) @ r(d)
    dSn = torch.stack(dsn, dim=2)
    dVn = torch.stack(dvn, dim=2)
    # dq, the first part of dk, dW, the first part of dG
    dM = r(doc) @ tr(Vn)
    dMG = dM * Gam
    PM = dMG * qk
    dG = PM.sum(-1) - PM.sum(-2)
    dQd = r(doc) @ tr(St)
    dKd = Vn @ tr(dSn)
    dW = r(-(dVn @ tr(St)))
    dq = r(dMG) @ r(kc) + dQd * eG[..., None]
    dk = tr(r(dMG)) @ r(qc) + dKd * tail[..., None]
    kr = r(kc)   # the kernels read k's operand copy here, elementwise too
    kd = (dKd * kr).sum(-1) * tail
    dG = dG + (dQd * qc).sum(-1) * eG - kd
    dgl = el * (St * dSn).sum((-1, -2)) + kd.sum(-1)
    # through the WY representation
    dT = dVn @ tr(r(vc * bc[..., None])) + dW @ tr(r(kr * coef[..., None]))
    dVb = tr(Tm) @ dVn
    dv = dVb * bc[..., None]
    dbeta = (dVb * vc).sum(-1)
    dA = torch.where(strict, -(r(tr(Tm) @ r(dT)) @ tr(Tm)), zero)
    R = dA * kk * torch.where(strict, Gam, zero)
    dbeta = dbeta + R.sum(-1)
    PA = R * bc[..., :, None]
    dG = dG + PA.sum(-1) - PA.sum(-2)
    D = dA * bc[..., :, None] * Gam
    dKb = tr(Tm) @ dW
    dk = dk + dKb * coef[..., None] + r(D + tr(D)) @ r(kc)
    kbk = (dKb * kr).sum(-1)
    dG = dG + kbk * coef
    dbeta = dbeta + kbk * eG
    dG = torch.cat([dG[..., :-1], (dG[..., -1] + dgl)[..., None]], dim=-1)
    dg = dG.flip(-1).cumsum(-1).flip(-1)

    def unpad(x):  # [B, H, nc, C, ...] -> [T, H, ...]
        x = x.reshape(B, H, W_, *x.shape[4:]).transpose(1, 2)
        return _unpad_seqs(x, starts, lens, T)

    dq = unpad(dq).view(T, Hk, rep, Dk).sum(2)
    dk = unpad(dk).view(T, Hk, rep, Dk).sum(2)
    return dq, dk, unpad(dv), unpad(dg), unpad(dbeta)
