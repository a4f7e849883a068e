"""The Gated DeltaNet core by CPR: the Triton twin. Four kernels (prep, state chain, per-token
recurrence, decode append), their launchers (shared with the stock twin in ``native.py``, which
passes its own dot precision) and the three cases. The schedule is the docstring of ``api.py``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._triton_util import jit, next_pow2, tl, upload_ints
from .cpr_wy import wy_boundary_chain, wy_resync
from .plan import HostPlan, _check, _check_state, _host_lens, _virtual_rows, engine_layout
from .state import BOUNDARY, CHUNK, GDNState


BLOCK_DV = 32
"""Dv tile of the Triton state and recurrent kernels (columns of S are independent)."""
BLOCK_DK = 32
"""Dk block of the Triton prep kernel (k.k^T accumulated over Dk blocks in order)."""


@jit
def _gdn_prep_kernel(
    k_ptr, v_ptr, g_ptr, b_ptr, row0_ptr, nrow_ptr,
    w_ptr, u_ptr, kd_ptr, el_ptr, t_ptr,
    H, REP, DK, DV, s_kt, s_kh, s_vt, s_vh, s_gt, s_bt,
    C: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr, STORE_T: tl.constexpr = False, INV_BS: tl.constexpr = 0,
):
    # One program per (chunk p, value head h). nrow[p] valid rows (the rest are zero: g = 0,
    # beta = 0, k = 0, which leaves the state untouched); nrow == 0 -> the program stores nothing.
    # STORE_T (the chunk backward only): T = (I + A)^-1 is stored too [P, H, C, C].
    p = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    n = tl.load(nrow_ptr + p)
    if n > 0:
        r0 = tl.load(row0_ptr + p).to(tl.int64)
        kh = h // REP
        t = tl.arange(0, C)
        ok = t < n
        rows = r0 + t
        g = tl.load(g_ptr + rows * s_gt + h, mask=ok, other=0.0).to(tl.float32)
        beta = tl.load(b_ptr + rows * s_bt + h, mask=ok, other=0.0).to(tl.float32)
        G = tl.cumsum(g, axis=0)
        kk = tl.zeros((C, C), dtype=tl.float32)
        for d0 in tl.static_range(0, DKP, BK):
            dc = d0 + tl.arange(0, BK)
            kb = tl.load(k_ptr + rows[:, None] * s_kt + kh * s_kh + dc[None, :],
                         mask=ok[:, None] & (dc[None, :] < DK), other=0.0).to(tl.float32)
            kk = tl.dot(kb, tl.trans(kb), kk, input_precision=PREC)
        i2 = t[:, None]
        j2 = t[None, :]
        lower = j2 < i2
        A = tl.where(lower, (kk * beta[:, None]) * tl.exp(tl.where(lower, G[:, None] - G[None, :], 0.0)), 0.0)
        if INV_BS == 0:
            # T = (I + A)^-1 by forward substitution: row i = e_i - sum_j A[i, j] T[j, :]
            Tm = tl.where(i2 == j2, 1.0, 0.0)
            for i in range(1, C):
                a_i = tl.sum(tl.where(i2 == i, A, 0.0), axis=0)
                x = tl.sum(a_i[:, None] * Tm, axis=0)
                Tm = tl.where(i2 == i, (tl.where(t == i, 1.0, 0.0) - x)[None, :], Tm)
        else:
            # blocked: D = (I + A_d)^-1 of the INV_BS x INV_BS diagonal blocks, by forward
            # substitution on all blocks at once (INV_BS - 1 steps instead of C - 1); then, with
            # I + A = (I + A_d)(I + N), N = D A_o strictly block-lower (N^NB = 0):
            # T = (I + N)^-1 D = D - N (D - N (... D)), NB - 1 dots
            NB: tl.constexpr = C // INV_BS
            blk = (i2 // INV_BS) == (j2 // INV_BS)
            A3 = tl.reshape(tl.where(blk, A, 0.0), (NB, INV_BS, C))
            D3 = tl.reshape(tl.where(i2 == j2, 1.0, 0.0), (NB, INV_BS, C))
            ri = tl.arange(0, INV_BS)[None, :, None]
            bb = tl.arange(0, NB)
            own = bb[:, None, None] == bb[None, :, None]
            for r in range(1, INV_BS):
                a = tl.sum(tl.where(ri == r, A3, 0.0), axis=1)                       # [NB, C]: row r of each block
                a16 = tl.sum(tl.where(own, tl.reshape(a, (NB, NB, INV_BS)), 0.0), axis=1)  # its own block's columns
                x = tl.sum(a16[:, :, None] * D3, axis=1)                             # [NB, C]
                e = tl.where(t[None, :] == bb[:, None] * INV_BS + r, 1.0, 0.0)
                D3 = tl.where(ri == r, (e - x)[:, None, :], D3)
            D = tl.reshape(D3, (C, C))
            N = tl.dot(D, tl.where(blk, 0.0, A), input_precision=PREC)
            Tm = D
            for _ in tl.static_range(NB - 1):
                Tm = D - tl.dot(N, Tm, input_precision=PREC)
        g_last = tl.sum(tl.where(t == C - 1, G, 0.0), axis=0)
        coef = beta * tl.exp(G)
        tail = tl.exp(g_last - G)
        base = (p * H + h) * C
        if STORE_T:
            tl.store(t_ptr + (base + i2) * C + j2, Tm)
        for d0 in tl.static_range(0, DKP, BK):
            dc = d0 + tl.arange(0, BK)
            dm = dc[None, :] < DK
            kb = tl.load(k_ptr + rows[:, None] * s_kt + kh * s_kh + dc[None, :],
                         mask=ok[:, None] & dm, other=0.0).to(tl.float32)
            w = tl.dot(Tm, kb * coef[:, None], input_precision=PREC)
            off = (base + t[:, None]) * DK + dc[None, :]
            tl.store(w_ptr + off, w, mask=dm)
            tl.store(kd_ptr + off, kb * tail[:, None], mask=dm)
        for v0 in tl.static_range(0, DVP, BV):
            vc = v0 + tl.arange(0, BV)
            vm = vc[None, :] < DV
            vb = tl.load(v_ptr + rows[:, None] * s_vt + h * s_vh + vc[None, :],
                         mask=ok[:, None] & vm, other=0.0).to(tl.float32)
            u = tl.dot(Tm, vb * beta[:, None], input_precision=PREC)
            tl.store(u_ptr + (base + t[:, None]) * DV + vc[None, :], u, mask=vm)
        tl.store(el_ptr + p * H + h, tl.exp(g_last))


@jit
def _gdn_state_kernel(
    w_ptr, u_ptr, kd_ptr, el_ptr, init_ptr, starts_ptr, fin_ptr, fin2_ptr, vnew_ptr,
    chunk0_ptr, nchunk_ptr, init_idx_ptr, starts0_ptr, fin_idx_ptr, fin2_idx_ptr,
    H, DK, DV,
    C: tl.constexpr, DKP: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, STORE_VNEW: tl.constexpr,
):
    # One program per (sequence/lane p, head h, Dv tile). S = init[init_idx] (zeros if < 0);
    # for c < nchunk: starts[starts0 + c] = S (if starts0 >= 0); S = chunk_update(S, chunk
    # chunk0 + c). Then starts[starts0 + nchunk] = S, and fin[fin_idx] = fin2[fin2_idx] = S when
    # nchunk > 0 and the index is >= 0. init and fin may alias (one program owns its tile).
    p = tl.program_id(0)
    h = tl.program_id(1)
    vt = tl.program_id(2)
    n = tl.load(nchunk_ptr + p)
    s0 = tl.load(starts0_ptr + p).to(tl.int64)
    # a program with no chunk and no start state to store has nothing to do (decode: every lane
    # whose chunk did not complete); it returns before loading its state tile
    if (n > 0) | (s0 >= 0):
        c0 = tl.load(chunk0_ptr + p).to(tl.int64)
        ii = tl.load(init_idx_ptr + p).to(tl.int64)
        dk = tl.arange(0, DKP)
        dv = vt * BV + tl.arange(0, BV)
        sm = (dk[:, None] < DK) & (dv[None, :] < DV)
        soff = dk[:, None] * DV + dv[None, :]
        hs = DK * DV
        S = tl.load(init_ptr + (tl.maximum(ii, 0) * H + h) * hs + soff, mask=sm & (ii >= 0), other=0.0)
        t = tl.arange(0, C)
        for c in range(0, n):
            tl.store(starts_ptr + ((tl.maximum(s0, 0) + c) * H + h) * hs + soff, S, mask=sm & (s0 >= 0))
            q = (c0 + c) * H + h
            km = dk[None, :] < DK
            W = tl.load(w_ptr + (q * C + t[:, None]) * DK + dk[None, :], mask=km, other=0.0)
            Kd = tl.load(kd_ptr + (q * C + t[:, None]) * DK + dk[None, :], mask=km, other=0.0)
            U = tl.load(u_ptr + (q * C + t[:, None]) * DV + dv[None, :], mask=dv[None, :] < DV, other=0.0)
            el = tl.load(el_ptr + q)
            Vn = U - tl.dot(W, S, input_precision=PREC)
            if STORE_VNEW:
                tl.store(vnew_ptr + (q * C + t[:, None]) * DV + dv[None, :], Vn, mask=dv[None, :] < DV)
            S = S * el + tl.dot(tl.trans(Kd), Vn, input_precision=PREC)
        tl.store(starts_ptr + ((tl.maximum(s0, 0) + n) * H + h) * hs + soff, S, mask=sm & (s0 >= 0))
        fi = tl.load(fin_idx_ptr + p).to(tl.int64)
        tl.store(fin_ptr + (tl.maximum(fi, 0) * H + h) * hs + soff, S, mask=sm & (fi >= 0) & (n > 0))
        f2 = tl.load(fin2_idx_ptr + p).to(tl.int64)
        tl.store(fin2_ptr + (tl.maximum(f2, 0) * H + h) * hs + soff, S, mask=sm & (f2 >= 0) & (n > 0))


@jit
def _gdn_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, init_ptr, fin_ptr,
    row0_ptr, nrow_ptr, init_idx_ptr, fin_idx_ptr,
    H, REP, DK, DV, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_bt, s_ot, s_oh,
    DKP: tl.constexpr, BV: tl.constexpr, PREFETCH: tl.constexpr = False,
):
    # One program per (segment p, head h, Dv tile): S = init[init_idx] (zeros if < 0), then the
    # per-token step for rows row0 .. row0 + nrow - 1 (output row = input row); finally
    # fin[fin_idx] = S if fin_idx >= 0. init and fin may alias (one program owns its tile).
    # PREFETCH: the next row's q, k, v, g, beta are loaded while this row's step runs (the step
    # waits on nothing but its own registers; the loads' latency, not the arithmetic, bounded the
    # loop). The arithmetic and its order are the same either way: same bits.
    p = tl.program_id(0)
    h = tl.program_id(1)
    vt = tl.program_id(2)
    n = tl.load(nrow_ptr + p)
    r0 = tl.load(row0_ptr + p).to(tl.int64)
    ii = tl.load(init_idx_ptr + p).to(tl.int64)
    kh = h // REP
    dk = tl.arange(0, DKP)
    dv = vt * BV + tl.arange(0, BV)
    km = dk < DK
    vm = dv < DV
    sm = km[:, None] & vm[None, :]
    soff = dk[:, None] * DV + dv[None, :]
    hs = DK * DV
    S = tl.load(init_ptr + (tl.maximum(ii, 0) * H + h) * hs + soff, mask=sm & (ii >= 0), other=0.0)
    if PREFETCH:
        live = n > 0
        qn = tl.load(q_ptr + r0 * s_qt + kh * s_qh + dk, mask=km & live, other=0.0).to(tl.float32)
        kn = tl.load(k_ptr + r0 * s_kt + kh * s_kh + dk, mask=km & live, other=0.0).to(tl.float32)
        vn = tl.load(v_ptr + r0 * s_vt + h * s_vh + dv, mask=vm & live, other=0.0).to(tl.float32)
        gn = tl.load(g_ptr + r0 * s_gt + h, mask=live, other=0.0).to(tl.float32)
        bn = tl.load(b_ptr + r0 * s_bt + h, mask=live, other=0.0).to(tl.float32)
    for i in range(0, n):
        r = r0 + i
        if PREFETCH:
            # this row's inputs came with the previous step; the next row's are issued now
            qv, kv, vv, gt, bt = qn, kn, vn, gn, bn
            rn = r + 1
            more = i + 1 < n
            qn = tl.load(q_ptr + rn * s_qt + kh * s_qh + dk, mask=km & more, other=0.0).to(tl.float32)
            kn = tl.load(k_ptr + rn * s_kt + kh * s_kh + dk, mask=km & more, other=0.0).to(tl.float32)
            vn = tl.load(v_ptr + rn * s_vt + h * s_vh + dv, mask=vm & more, other=0.0).to(tl.float32)
            gn = tl.load(g_ptr + rn * s_gt + h, mask=more, other=0.0).to(tl.float32)
            bn = tl.load(b_ptr + rn * s_bt + h, mask=more, other=0.0).to(tl.float32)
        else:
            qv = tl.load(q_ptr + r * s_qt + kh * s_qh + dk, mask=km, other=0.0).to(tl.float32)
            kv = tl.load(k_ptr + r * s_kt + kh * s_kh + dk, mask=km, other=0.0).to(tl.float32)
            vv = tl.load(v_ptr + r * s_vt + h * s_vh + dv, mask=vm, other=0.0).to(tl.float32)
            gt = tl.load(g_ptr + r * s_gt + h).to(tl.float32)
            bt = tl.load(b_ptr + r * s_bt + h).to(tl.float32)
        S = S * tl.exp(gt)
        mem = tl.sum(S * kv[:, None], axis=0)
        delta = (vv - mem) * bt
        S = S + kv[:, None] * delta[None, :]
        o = tl.sum(S * qv[:, None], axis=0)
        tl.store(o_ptr + r * s_ot + h * s_oh + dv, o, mask=vm)
    fi = tl.load(fin_idx_ptr + p).to(tl.int64)
    tl.store(fin_ptr + (tl.maximum(fi, 0) * H + h) * hs + soff, S, mask=sm & (fi >= 0))


@jit
def _gdn_append_kernel(
    k_ptr, v_ptr, g_ptr, b_ptr, slots_ptr, fill_ptr, bk_ptr, bv_ptr, bg_ptr, bb_ptr,
    H, REP, DK, DV, s_kt, s_kh, s_vt, s_vh, s_gt, s_bt,
    C: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr,
):
    # Decode: buf[slot, fill[slot]] = this lane's token (k expanded to the value head).
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    f = tl.minimum(tl.load(fill_ptr + slot), C - 1).to(tl.int64)
    row = (slot * C + f) * H + h
    dk = tl.arange(0, DKP)
    dv = tl.arange(0, DVP)
    kv = tl.load(k_ptr + b * s_kt + (h // REP) * s_kh + dk, mask=dk < DK, other=0.0).to(tl.float32)
    tl.store(bk_ptr + row * DK + dk, kv, mask=dk < DK)
    vv = tl.load(v_ptr + b * s_vt + h * s_vh + dv, mask=dv < DV, other=0.0).to(tl.float32)
    tl.store(bv_ptr + row * DV + dv, vv, mask=dv < DV)
    tl.store(bg_ptr + row, tl.load(g_ptr + b * s_gt + h).to(tl.float32))
    tl.store(bb_ptr + row, tl.load(b_ptr + b * s_bt + h).to(tl.float32))


@dataclass(frozen=True)
class CPRKernelChoice:
    """The numerical and tiling choices of CPR's Triton kernels that move bits: the input
    precision of every fp32 ``tl.dot`` in the prep and state kernels (``"ieee"``: fp32 FMA,
    ``"tf32x3"``: three TF32 tensor-core products, about fp32 accuracy), how the prep inverts
    I + A (``inv_bs`` 0: row by row; 16: diagonal blocks merged by dots) and the Dv tile and
    warp count of the per-token kernel (its ``tl.sum`` over Dk reduces in the layout's order), and
    the form of the boundary update (``boundary``: "rows", the prep and state kernels here; "wy",
    the native chunk path's kernels at fp32 operands, ``cpr_wy.py``). ``rec_prefetch`` loads the
    per-token kernel's next row during the current step: scheduling only, the same bits.
    ``wy_bk`` / ``wy_warps``: the "wy" form's dot block and warps. Every
    case (trainer, prefill, decode) takes the same choice, so any choice keeps them equal; a
    different choice gives other bits. ``PINNED`` is the one the ``gdn_cpr`` impl runs;
    ``scripts/cpr_variant_sweep.py`` times and checks the others on a GPU."""

    dot: str = "tf32x3"
    rec_bv: int = 32
    rec_warps: int = 4
    inv_bs: int = 0
    boundary: str = "rows"
    rec_prefetch: bool = False
    wy_bk: int = 64
    wy_warps: int = 4

    def __post_init__(self):
        if self.boundary not in ("rows", "wy"):
            raise ValueError(f"CPRKernelChoice.boundary must be 'rows' or 'wy'; got {self.boundary!r}")
        if self.boundary == "wy" and self.inv_bs:
            raise ValueError("CPRKernelChoice: inv_bs belongs to the 'rows' boundary form (the 'wy' form "
                             "always inverts by 16 x 16 blocks)")


PINNED = CPRKernelChoice(boundary=BOUNDARY, rec_prefetch=True)
"""``gdn_cpr`` version 3: the WY boundary form, tf32x3 dots, the per-token kernel at a 32-wide Dv
tile on 4 warps with the next row prefetched (version 2: the rows form, no prefetch; on the H200
at ``c3a9c7c`` version 3 took the forward from 8.0 to 6.0 ms and decode from 0.61 to 0.51 ms)."""


def tile_constants(Dk: int, Dv: int) -> dict:
    """Triton tiles and warps, a function of (Dk, Dv) only (pinned; never of T or batch)."""
    return dict(DKP=max(16, next_pow2(Dk)), DVP=max(16, next_pow2(Dv)),
                BK=min(BLOCK_DK, max(16, next_pow2(Dk))), BV=min(BLOCK_DV, max(16, next_pow2(Dv))),
                prep_warps=8, state_warps=8, rec_warps=4)


def _i32(xs, dev) -> torch.Tensor:
    return upload_ints(xs, torch.int32, dev)


def launch_prep(k, v, g, beta, row0, nrow, H, rep, chunk, prec="ieee", t_out=None, inv_bs=0):
    """Prep for P chunks (row0/nrow int32 device tensors [P]); k [*, Hk, Dk] (rows by token),
    v [*, H, Dv], g, beta [*, H], last dims contiguous. Returns (W, U, Kd, e_last); with ``t_out``
    [P, H, C, C] fp32 also stores each chunk's T = (I + A)^-1 there (the chunk backward needs it).
    ``inv_bs``: 0 inverts (I + A) row by row; 16 (a divisor of C) by diagonal blocks merged by
    dots (other bits)."""
    if inv_bs and (chunk % inv_bs or inv_bs < 16):
        raise ValueError(f"inv_bs {inv_bs} must be >= 16 and divide the chunk {chunk}")
    Dk, Dv = k.shape[-1], v.shape[-1]
    P = row0.shape[0]
    tc = tile_constants(Dk, Dv)
    dev = v.device
    W = torch.empty(P, H, chunk, Dk, dtype=torch.float32, device=dev)
    U = torch.empty(P, H, chunk, Dv, dtype=torch.float32, device=dev)
    Kd = torch.empty_like(W)
    el = torch.empty(P, H, dtype=torch.float32, device=dev)
    if P:
        _gdn_prep_kernel[(P, H)](
            k, v, g, beta, row0, nrow, W, U, Kd, el, t_out if t_out is not None else el, H, rep, Dk, Dv,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
            C=chunk, DKP=tc["DKP"], DVP=tc["DVP"], BK=tc["BK"], BV=tc["BV"], PREC=prec,
            STORE_T=t_out is not None, INV_BS=inv_bs, num_warps=tc["prep_warps"])
    return W, U, Kd, el


def launch_state(prep, init, starts, fin, fin2, chunk0, nchunk, init_idx, starts0, fin_idx, fin2_idx,
                 chunk, prec="ieee", vnew=None):
    """Pass 1 / resync over P sequences or lanes (index tensors int32 [P]); see the kernel."""
    W, U, Kd, el = prep
    H, Dk, Dv = init.shape[1], init.shape[2], init.shape[3]
    P = chunk0.shape[0]
    tc = tile_constants(Dk, Dv)
    if P:
        grid = (P, H, triton_cdiv(Dv, tc["BV"]))
        _gdn_state_kernel[grid](
            W, U, Kd, el, init, starts, fin, fin2, vnew if vnew is not None else U,
            chunk0, nchunk, init_idx, starts0, fin_idx, fin2_idx, H, Dk, Dv,
            C=chunk, DKP=tc["DKP"], BV=tc["BV"], PREC=prec, STORE_VNEW=vnew is not None,
            # the tf32 (native) variant's pipelined buffers overflow Hopper's 227 KB of shared
            # memory at Dk = Dv = 128 (measured: 240 KB); 3 is Triton's default, kept for CPR
            num_warps=tc["state_warps"], num_stages=3 if prec == "ieee" else 1)


def launch_recurrent(q, k, v, g, beta, o, init, fin, row0, nrow, init_idx, fin_idx, H, rep,
                     choice: CPRKernelChoice = PINNED):
    """Per-token recurrence over P segments (index tensors int32 [P]); see the kernel. The Dv
    tile and warps are ``choice.rec_bv`` / ``choice.rec_warps``."""
    Dk, Dv = k.shape[-1], v.shape[-1]
    P = row0.shape[0]
    tc = tile_constants(Dk, Dv)
    bv = min(choice.rec_bv, tc["DVP"])
    if P:
        grid = (P, H, triton_cdiv(Dv, bv))
        _gdn_recurrent_kernel[grid](
            q, k, v, g, beta, o, init, fin, row0, nrow, init_idx, fin_idx, H, rep, Dk, Dv,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), beta.stride(0), o.stride(0), o.stride(1),
            DKP=tc["DKP"], BV=bv, PREFETCH=choice.rec_prefetch, num_warps=choice.rec_warps)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _rows3(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def _core_triton(q, k, v, g, beta, starts, lens, init, rep, chunk, choice=PINNED):
    """CPR over B segments (each starting on a chunk boundary) by the Triton kernels.
    Returns (o [T, H, Dv] fp32, boundary [B, H, Dk, Dv], running [B, H, Dk, Dv])."""
    T, Hk, Dk = k.shape
    H, Dv = v.shape[1], v.shape[2]
    dev = v.device
    B = len(lens)
    C = chunk
    q, k, v = _rows3(q), _rows3(k), _rows3(v)
    g, beta = g.contiguous(), beta.contiguous()
    # host plan
    p_row0, chunk0, nchunk, starts0 = [], [], [], []
    seg_row0, seg_n, seg_init, seg_fin = [], [], [], []
    n_starts = 0
    for b, (s, L) in enumerate(zip(starts, lens)):
        nf = L // C
        chunk0.append(len(p_row0))
        nchunk.append(nf)
        starts0.append(n_starts)
        p_row0 += [s + c * C for c in range(nf)]
        for c in range((L + C - 1) // C):
            seg_row0.append(s + c * C)
            seg_n.append(min(C, L - c * C))
            seg_init.append(n_starts + c)
            seg_fin.append(b if (c == L // C) else -1)  # the trailing partial chunk
        n_starts += nf + 1
    P = len(p_row0)
    if choice.boundary == "wy":
        # the entering states of the complete chunks, then one boundary per segment (cpr_wy.py);
        # re-index the per-token segments onto that layout
        starts_t = wy_boundary_chain(k, v, g, beta, p_row0, chunk0, nchunk, init, rep, C, choice)
        boundary = starts_t[P:]
        seg_init = [(chunk0[b] + c) if c < nchunk[b] else P + b
                    for b, L in enumerate(lens) for c in range((L + C - 1) // C)]
    else:
        prep = launch_prep(k, v, g, beta, _i32(p_row0, dev), _i32([C] * P, dev), H, rep, C, prec=choice.dot,
                           inv_bs=choice.inv_bs)
        init_t = init if init is not None else torch.zeros(1, H, Dk, Dv, dtype=torch.float32, device=dev)
        boundary = (init.clone() if init is not None
                    else torch.zeros(B, H, Dk, Dv, dtype=torch.float32, device=dev))
        starts_t = torch.empty(max(n_starts, 1), H, Dk, Dv, dtype=torch.float32, device=dev)
        launch_state(prep, init_t, starts_t, boundary, boundary, _i32(chunk0, dev), _i32(nchunk, dev),
                     _i32(range(B) if init is not None else [-1] * B, dev), _i32(starts0, dev),
                     _i32(range(B), dev), _i32([-1] * B, dev), C, prec=choice.dot)
    o = torch.empty(T, H, Dv, dtype=torch.float32, device=dev)
    running = boundary.clone()
    launch_recurrent(q, k, v, g, beta, o, starts_t, running, _i32(seg_row0, dev), _i32(seg_n, dev),
                     _i32(seg_init, dev), _i32(seg_fin, dev), H, rep, choice)
    return o, boundary, running


def gdn_cpr_varlen_triton(q, k, v, g, beta, cu_seqlens, *, chunk: int = CHUNK,
                          choice: CPRKernelChoice = PINNED) -> torch.Tensor:
    """Trainer case by the Triton kernels (forward only). CUDA, or CPU under the interpreter."""
    T, Hk, Dk, H, Dv = _check(q, k, v, g, beta, "gdn_cpr_varlen_triton")
    starts, lens = _host_lens(cu_seqlens)
    o, _, _ = _core_triton(q, k, v, g, beta, starts, lens, None, H // Hk, chunk, choice)
    return o


def gdn_cpr_engine_triton(q, k, v, g, beta, cu_seqlens_q, slots, state: GDNState, *,
                          chunk: int = CHUNK, choice: CPRKernelChoice = PINNED,
                          host: HostPlan | None = None) -> torch.Tensor:
    """Engine prefill by the Triton kernels; updates ``state`` in place. The slots' fill counts and
    the sequence lengths plan the launch: from ``host`` (``plan.HostPlan``) when given, else read
    back from the device (host syncs)."""
    T, Hk, Dk, H, Dv = _check(q, k, v, g, beta, "gdn_cpr_engine_triton")
    _check_state(state, H, Dk, Dv, chunk, "gdn_cpr_engine_triton")
    rep = H // Hk
    dev = v.device
    starts, lens, slots_l, fills = engine_layout(host, cu_seqlens_q, slots, state, chunk, T, "gdn_cpr_engine_triton")
    slots_t = slots.to(device=dev, dtype=torch.long)
    init = state.boundary.index_select(0, slots_t)
    if not any(fills):
        # every sequence starts on a boundary: run on the inputs as they are
        vstarts, vlens = starts, lens
        qv_, kv_, vv_, gv_, bv_ = q, k, v, g, beta
        new_dst = new_src = None
    else:
        vstarts, vlens, new_dst, new_src, pre_dst, pre_slot, pre_pos = _virtual_rows(
            state, slots_l, fills, starts, lens, chunk)
        Tv = sum(vlens)
        ix = lambda xs: upload_ints(xs, torch.long, dev)  # noqa: E731
        nd, ns, pd, ps, pp = ix(new_dst), ix(new_src), ix(pre_dst), ix(pre_slot), ix(pre_pos)
        f32 = dict(dtype=torch.float32, device=dev)
        qv_ = torch.zeros(Tv, Hk, Dk, **f32)
        kv_ = torch.zeros(Tv, Hk, Dk, **f32)
        vv_ = torch.zeros(Tv, H, Dv, **f32)
        gv_ = torch.zeros(Tv, H, **f32)
        bv_ = torch.zeros(Tv, H, **f32)
        qv_[nd] = q[ns].float()
        kv_[nd] = k[ns].float()
        vv_[nd] = v[ns].float()
        gv_[nd] = g[ns].float()
        bv_[nd] = beta[ns].float()
        kv_[pd] = state.buf_k[ps, pp][:, ::rep]  # value heads of one group hold the same key
        vv_[pd] = state.buf_v[ps, pp]
        gv_[pd] = state.buf_g[ps, pp]
        bv_[pd] = state.buf_beta[ps, pp]
    o_v, boundary, running = _core_triton(qv_, kv_, vv_, gv_, bv_, vstarts, vlens, init, rep, chunk, choice)
    # state write-back (buffers hold the trailing partial chunk, k expanded per value head)
    keep = [b for b, L in enumerate(vlens) if L > 0]
    if keep:
        kb = upload_ints(keep, torch.long, dev)
        sl = slots_t.index_select(0, kb)
        state.boundary.index_copy_(0, sl, boundary.index_select(0, kb))
        state.running.index_copy_(0, sl, running.index_select(0, kb))
        rem = [vlens[b] % chunk for b in keep]
        b_slot, b_pos, b_row = [], [], []
        for b, r in zip(keep, rem):
            a = vstarts[b] + vlens[b] - r
            b_slot += [slots_l[b]] * r
            b_pos += range(r)
            b_row += range(a, a + r)
        if b_row:
            ix = lambda xs: upload_ints(xs, torch.long, dev)  # noqa: E731
            bs, bp, br = ix(b_slot), ix(b_pos), ix(b_row)
            state.buf_k[bs, bp] = kv_[br].float().repeat_interleave(rep, dim=1)
            state.buf_v[bs, bp] = vv_[br].float()
            state.buf_g[bs, bp] = gv_[br].float()
            state.buf_beta[bs, bp] = bv_[br].float()
        state.fill.index_copy_(0, sl, upload_ints(rem, torch.int32, dev))
    if new_dst is None:
        return o_v
    out = torch.empty(T, H, Dv, dtype=torch.float32, device=dev)
    out[ns] = o_v[nd]
    return out


def gdn_cpr_decode_triton(q, k, v, g, beta, slots, state: GDNState, *, chunk: int = CHUNK,
                          choice: CPRKernelChoice = PINNED) -> torch.Tensor:
    """Engine decode by the Triton kernels; updates ``state``. No host sync, no data-dependent
    Python control flow: the resync (prep + state kernels) is launched for every lane and does
    nothing for lanes whose chunk did not complete (chunk count 0 on device)."""
    B, Hk, Dk, H, Dv = _check(q, k, v, g, beta, "gdn_cpr_decode_triton")
    rep = H // Hk
    dev = v.device
    q, k, v = _rows3(q), _rows3(k), _rows3(v)
    g, beta = g.contiguous(), beta.contiguous()
    slots32 = slots.to(device=dev, dtype=torch.int32)
    o = torch.empty(B, H, Dv, dtype=torch.float32, device=dev)
    one = torch.ones(B, dtype=torch.int32, device=dev)
    lanes = torch.arange(B, dtype=torch.int32, device=dev)
    launch_recurrent(q, k, v, g, beta, o, state.running, state.running, lanes, one, slots32, slots32, H, rep,
                     choice)
    tc = tile_constants(Dk, Dv)
    if B:
        _gdn_append_kernel[(B, H)](
            k, v, g, beta, slots32, state.fill, state.buf_k, state.buf_v, state.buf_g, state.buf_beta,
            H, rep, Dk, Dv, k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
            C=chunk, DKP=tc["DKP"], DVP=tc["DVP"], num_warps=1)
    sl = slots32.long()
    f1 = state.fill.index_select(0, sl).clamp(max=chunk - 1) + 1
    full = (f1 == chunk).to(torch.int32)
    if choice.boundary == "wy":
        wy_resync(state, slots32, full, lanes, chunk, choice)
    else:
        bk, bv, bg, bb = state.buffer_rows()
        prep = launch_prep(bk, bv, bg, bb, slots32 * chunk, full * chunk, H, 1, chunk, prec=choice.dot,
                           inv_bs=choice.inv_bs)
        launch_state(prep, state.boundary, state.boundary, state.boundary, state.running, lanes, full, slots32,
                     torch.full_like(lanes, -1), slots32, slots32, chunk, prec=choice.dot)
    state.fill.index_put_((sl,), (f1 * (1 - full)).to(torch.int32))
    return o
