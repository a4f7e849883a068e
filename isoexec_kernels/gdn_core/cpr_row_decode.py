"""CPR version 4's decode by rows: one token per lane, row t of the chunk form alone instead of the
whole open chunk (docs/cpr.md, "The row-only decode").

The prefix decode (``cpr_chunk.cpr4_decode_prefix_triton``) runs the four native WY kernels on the
open chunk's rows so far at every step and keeps the last row. Here a step at in-chunk position t
runs four kernels:

1. ``_cpr4_row_prep_kernel``'s row-inverse part, one program per (value head, lane) on the inverse
   kernel's warps: G for the rows so far and row t of T = (I + A)^-1, made as the inverse kernel
   makes it on rows 0..t (its block cumsums, the k k^T tiles of row t's 16-row block, the diagonal block's forward
   substitution up to row t by the kernel's own loop, its nesting of 16 x 16 dots for
   the blocks left of the diagonal) but from the complete blocks' rows of T kept in the slot
   (``GDNState.buf_T``, fp32, filled by prefill too) instead of every block's substitution;
2. the same kernel's W/M part (a second launch), one program per (value head, lane): the parts of
   row t that do not depend on the Dv tile, from the open chunk's k rows read once:
   W_t = r(T_t) r(k beta e^G) as the
   W/U kernel (which stores it in bf16), in its Dk column blocks, and the output kernel's row
   M_tj = (q_t . k_j) e^{G_t - G_j} (j <= t), its q dots over Dk in the same BK blocks;
3. ``_cpr4_row_kernel``, one program per (Dv tile, value head, lane), with the native kernels'
   operations for row t only, each dot with row t alone in its operand tile (the other rows zero):
   U_t = r(T_t) r(v beta) as the W/U kernel, Vn_t = U_t - r(W_t) r(S) as the state kernel (S the
   slot's fp32 ``boundary``, the state entering the open chunk), kept unrounded in the slot's
   ``buf_vn``, then o_t = e^{G_t} (r(q_t) r(S)) + r(M_t) r(Vn) as the output kernel, its q dots
   over Dk in the same BK blocks, Vn's rows j < t read from ``buf_vn``, where earlier steps (or the
   prefill that opened the chunk) left them;
4. ``_cpr4_complete_kernel``: where the step completes the chunk (t = C - 1), ``boundary`` carried
   across it as the state kernel does, S' = r(k)^T r(Vn e^(G_t - G)) + e^{G_t} S from the
   unrounded Vn rows (the other lanes' programs return at once).

Why the bits are prefill's: every row of the chunk form depends only on rows 0..t (the prefix
property, measured on the H200 through these kernels: ``scripts/chunk_prefix_probe.py``), and each
dot here is the prefill kernel's dot with the rows other than t zeroed, which an output row of a
matrix product does not read. The operand tiles have ``ROW_TILE`` rows on a GPU (16: a row alone
in a 16-row tile rounds as in the 64-row product on the H200, ``scripts/row_product_probe.py``, and
gave the same outputs as C-row tiles in the probe) and C rows under the interpreter, the native
kernels' own tiles, whose dots there are BLAS calls blocked by shape (a 16-row tile differs from the
64-row product in the last bit on the CPU). The GPU probe (``scripts/cpr4_probe.py``) counts
differing outputs against the trainer and against the prefix decode. Rounding schedule: the native
kernels' "bf16" mode (``native_wy.py``): bf16 operands, fp32 accumulation, W and U rounded to bf16
before use, Vn rounded to bf16 as an operand of the output (and kept unrounded for the state), T
and the state in fp32.

Cost per step: the boundary state read once per lane (as native decode reads its state, and written
back where the chunk completes), the open chunk's buffered rows, and row t of the inverse. History
at 256 lanes on the H200 (``scripts/cpr4_probe.py``): until ``c0e2f72`` step 1 was the inverse kernel
itself on the rows so far (0.27 ms of a 0.93 ms step); the row-inverse kernel took 0.11 ms at
``ddfa0d3`` (step 0.78 ms, 0.57 of it the row kernel, which then also made W_t and M_t from the k rows
in each of its Dv tiles' programs); at ``a2721da`` the step took 0.60 ms (row kernel 0.35, row-inverse
0.11, W/M 0.09, completion 0.03, append 0.008). The row kernel reads the state only as a bf16
operand, so it reads the slot's bf16 copy (``GDNState.boundary_op``, kept by prefill and the
completion kernel): half the bytes of the fp32 boundary, most of what it reads (0.228 ms at
``eb18911``); the open chunk's Vn rows likewise (``GDNState.buf_vn_op``, written beside the unrounded
rows the completion reads): 0.213 ms, a step of 0.464 ms at ``5beff10``; and v's rows in their bf16
(``GDNState.allocate(..., value_dtype=)``): 0.199 ms, a step of 0.449 ms at ``c158c85``; 0.4336 ms
with the diagonal substitution by the inverse kernel's loop (7d4cc88). At aed6b0b (profile at
3a08aee: row-inverse 0.106 ms, its one warp spilling; W/M 0.092; row kernel 0.186 with one dot for
W_t S and q_t S, 0.199 with two) the parts' pinned tiles below took the step from 0.4214 to 0.3852 ms
(native recurrent decode 0.3368 in the same run). Under the
interpreter both
copies are written but the fp32 originals read (its conversion truncates where torch's, which makes
prefill's copies, rounds to nearest even).
"""

from __future__ import annotations

import torch

from .._triton_util import interpreting, jit, next_pow2, tl
from .native_wy import _dtypes, state_tile
from .reference import _expand_heads
from .state import CHUNK, GDNState


@jit
def _cpr4_append_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, bq_ptr, bk_ptr, bv_ptr, bg_ptr, bb_ptr, fill_ptr, slot_ptr, pos_ptr,
    H, REP_Q, REP_K, DK, DV,
    C: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr,
):
    # One program per (value head h, lane b): the lane's token into its slot's open chunk at the
    # slot's fill, in fp32 (v in the buffer's dtype: fp32, or v's own where the state keeps that),
    # q and k from the head h // rep that value head h reads (what
    # ``append_token`` writes, in one launch instead of six indexing kernels); the head-0 program
    # records the position for the step's other kernels (``fill`` moves in the completion kernel).
    h = tl.program_id(0)
    b = tl.program_id(1)
    s = tl.load(slot_ptr + b).to(tl.int64)
    t = tl.load(fill_ptr + s)
    tl.store(pos_ptr + b, t, mask=h == 0)
    row = (s * C + t) * H + h
    dk = tl.arange(0, DKP)
    km = dk < DK
    dv = tl.arange(0, DVP)
    vm = dv < DV
    hq = H // REP_Q
    hk = H // REP_K
    q = tl.load(q_ptr + (b.to(tl.int64) * hq + h // REP_Q) * DK + dk, mask=km, other=0.0)
    k = tl.load(k_ptr + (b.to(tl.int64) * hk + h // REP_K) * DK + dk, mask=km, other=0.0)
    v = tl.load(v_ptr + (b.to(tl.int64) * H + h) * DV + dv, mask=vm, other=0.0)
    tl.store(bq_ptr + row * DK + dk, q.to(tl.float32), mask=km)
    tl.store(bk_ptr + row * DK + dk, k.to(tl.float32), mask=km)
    tl.store(bv_ptr + row * DV + dv, v.to(bv_ptr.dtype.element_ty), mask=vm)   # fp32, or v's own dtype
    tl.store(bg_ptr + row, tl.load(g_ptr + b.to(tl.int64) * H + h).to(tl.float32))
    tl.store(bb_ptr + row, tl.load(b_ptr + b.to(tl.int64) * H + h).to(tl.float32))


@jit
def _cpr4_row_prep_kernel(
    q_ptr, k_ptr, g_ptr, b_ptr, gc_ptr, tc_ptr, w_ptr, m_ptr, slot_ptr, pos_ptr, H, DK,
    C: tl.constexpr, NB: tl.constexpr, ROWS: tl.constexpr, DKP: tl.constexpr, BK: tl.constexpr,
    OP_DT: tl.constexpr, DOT_DT: tl.constexpr, PREC: tl.constexpr, INV_PREC: tl.constexpr,
    DO_T: tl.constexpr, DO_WM: tl.constexpr,
):
    # One program per (value head h, lane b): the parts of row t that do not depend on the Dv tile,
    # in two parts that run as two launches (DO_T, then DO_WM; each on its own warps) or as one
    # (both: the open chunk's k rows, read by each part, then come from the cache the first read
    # filled, and a launch less).
    #
    # DO_T (the row-inverse; on the inverse kernel's warps): G for the rows so far (stored
    # [S * C, H]) and row t of T = (I + A)^-1 (stored in the slot's fp32 rows of T, [S * C, H, C]),
    # made as ``native_wy._wy_inverse_kernel`` makes it on the rows 0..t, with the earlier rows of T
    # read from the slot instead of recomputed: G by the kernel's block cumsums, the k k^T tiles of
    # row block a = t // 16 over Dk in blocks of BK, one step (i = t % 16) of the diagonal block's
    # forward substitution from its kept rows 0..i-1, then the blocks left of the diagonal by the
    # kernel's nesting of 16 x 16 dots on the kept complete blocks. Every tile has the kernel's shape
    # and masks (rows after t zero), so each operation rounds as in the kernel.
    #
    # DO_WM (after DO_T): W_t = r(T_t) r(k beta e^G) as the W/U kernel, in Dk column blocks of BK
    # (each block an independent dot over the C rows, as in that kernel), stored rounded to the
    # operand dtype (in fp32: exact), and the output kernel's masked, decayed row M_t of q k^T, its q
    # dots over Dk accumulated in the same BK blocks, stored unrounded. Row t sits at row t % ROWS of
    # ROWS-row operand tiles, the other rows zero.
    h = tl.program_id(0)
    b = tl.program_id(1)
    s = tl.load(slot_ptr + b).to(tl.int64)
    t = tl.load(pos_ptr + b)
    r0 = s * C
    if DO_T:
        n = t + 1
        a = t // 16
        i = t % 16
        s_kt = H * DK
        kb = k_ptr + (r0 * H + h) * DK
        gb = g_ptr + r0 * H + h
        bb = b_ptr + r0 * H + h
        cb = gc_ptr + r0 * H + h
        tb = tc_ptr + (r0 * H + h) * C                 # row r of T: tb + r * (H * C) + column
        tt = tl.arange(0, 16)
        i2 = tt[:, None]
        j2 = tt[None, :]
        eye = tl.where(i2 == j2, 1.0, 0.0)
        strict = j2 < i2
        # G as the inverse kernel computes it (a block's cumsum plus the sums of the blocks before it)
        ok0 = tt < n
        g0 = tl.load(gb + tt * H, mask=ok0, other=0.0).to(tl.float32)
        G0 = tl.cumsum(g0, axis=0)
        tl.store(cb + tt * H, G0, mask=ok0)
        Ga = G0
        Gp0 = G0
        Gp1 = G0
        Gp2 = G0
        if NB >= 2:
            ok1 = tt + 16 < n
            g1 = tl.load(gb + (tt + 16) * H, mask=ok1, other=0.0).to(tl.float32)
            G1 = tl.cumsum(g1, axis=0) + tl.sum(g0, axis=0)
            tl.store(cb + (tt + 16) * H, G1, mask=ok1)
            Ga = tl.where(a == 1, G1, Ga)
            Gp1 = G1
        if NB >= 4:
            ok2 = tt + 32 < n
            ok3 = tt + 48 < n
            g2 = tl.load(gb + (tt + 32) * H, mask=ok2, other=0.0).to(tl.float32)
            g3 = tl.load(gb + (tt + 48) * H, mask=ok3, other=0.0).to(tl.float32)
            s01 = tl.sum(g0, axis=0) + tl.sum(g1, axis=0)
            G2 = tl.cumsum(g2, axis=0) + s01
            G3 = tl.cumsum(g3, axis=0) + (s01 + tl.sum(g2, axis=0))
            tl.store(cb + (tt + 32) * H, G2, mask=ok2)
            tl.store(cb + (tt + 48) * H, G3, mask=ok3)
            Ga = tl.where(a == 2, G2, tl.where(a == 3, G3, Ga))
            Gp2 = G2
        # row block a of k k^T: kk_ac for c <= a (each c < a complete, row block a masked after t)
        ra = a * 16 + tt
        oka = ra < n
        bea = tl.load(bb + ra * H, mask=oka, other=0.0).to(tl.float32)
        kka0 = tl.zeros((16, 16), dtype=tl.float32)
        kka1 = tl.zeros((16, 16), dtype=tl.float32)
        kka2 = tl.zeros((16, 16), dtype=tl.float32)
        kkaa = tl.zeros((16, 16), dtype=tl.float32)
        for d0 in tl.static_range(0, DKP, BK):
            dc = d0 + tl.arange(0, BK)
            dm = dc[None, :] < DK
            kp = kb + dc[None, :]
            ka = tl.load(kp + ra[:, None] * s_kt, mask=oka[:, None] & dm, other=0.0).to(OP_DT).to(DOT_DT)
            kkaa = tl.dot(ka, tl.trans(ka), kkaa, input_precision=PREC)
            # block c's rows only where row block a reads kk_ac (c < a; the others' tiles stay unused,
            # and unread: half the k bytes of a step on average)
            if NB >= 2:
                k0 = tl.load(kp + i2 * s_kt, mask=dm & (a >= 1), other=0.0).to(OP_DT).to(DOT_DT)
                kka0 = tl.dot(ka, tl.trans(k0), kka0, input_precision=PREC)
            if NB >= 4:
                k1 = tl.load(kp + (i2 + 16) * s_kt, mask=dm & (a >= 2), other=0.0).to(OP_DT).to(DOT_DT)
                k2 = tl.load(kp + (i2 + 32) * s_kt, mask=dm & (a >= 3), other=0.0).to(OP_DT).to(DOT_DT)
                kka1 = tl.dot(ka, tl.trans(k1), kka1, input_precision=PREC)
                kka2 = tl.dot(ka, tl.trans(k2), kka2, input_precision=PREC)
        Aaa = tl.where(strict, bea[:, None] * kkaa * tl.exp(tl.where(strict, Ga[:, None] - Ga[None, :], 0.0)), 0.0)
        # the diagonal block's steps 1..i as the inverse kernel's loop takes them from the identity:
        # each step's sums over the tile's rows then run in the tree of that loop's tile layout (on
        # the H200 a single step i from the kept rows 0..i-1 summed in another order: rows of T one ulp
        # off the inverse kernel's at 868ff99, and 32 of 31,297,536 outputs differing in the gdn_core
        # case_parity gate at 8740ae8; with the loop 0, at 0.4336 ms a decode step against 0.4256)
        Taa = eye
        for ii in range(1, i + 1):
            sel_ii = i2 == ii
            e_ii = tl.where(tt == ii, 1.0, 0.0)
            a_ii = tl.sum(tl.where(sel_ii, Aaa, 0.0), axis=0)
            Taa = tl.where(sel_ii, (e_ii - tl.sum(a_ii[:, None] * Taa, axis=0))[None, :], Taa)
        sel = i2 == i
        rt = tb + t * (H * C)                          # row t of T
        tl.store(rt + i2 * 0 + a * 16 + tt[None, :], Taa, mask=sel)
        zero = tl.zeros((16, 16), dtype=tl.float32)
        for cblk in tl.static_range(0, NB):            # zero right of the diagonal block
            tl.store(rt + i2 * 0 + cblk * 16 + tt[None, :], zero, mask=sel & (cblk > a))
        # the blocks left of the diagonal: T_ab = -T_aa (sum_c A_ac T_cb), the inverse kernel's nesting
        if NB >= 2:
            if a >= 1:
                Aa0 = bea[:, None] * kka0 * tl.exp(Ga[:, None] - Gp0[None, :])
                T00 = tl.load(tb + i2 * (H * C) + j2)
                if a == 1:
                    T10 = -tl.dot(Taa, tl.dot(Aa0, T00, input_precision=INV_PREC), input_precision=INV_PREC)
                    tl.store(rt + i2 * 0 + tt[None, :], T10, mask=sel)
                if NB >= 4:
                    if a >= 2:
                        Aa1 = bea[:, None] * kka1 * tl.exp(Ga[:, None] - Gp1[None, :])
                        T10 = tl.load(tb + (i2 + 16) * (H * C) + j2)
                        T11 = tl.load(tb + (i2 + 16) * (H * C) + 16 + j2)
                        if a == 2:
                            T21 = -tl.dot(Taa, tl.dot(Aa1, T11, input_precision=INV_PREC), input_precision=INV_PREC)
                            T20 = -tl.dot(Taa, tl.dot(Aa1, T10, tl.dot(Aa0, T00, input_precision=INV_PREC),
                                                      input_precision=INV_PREC), input_precision=INV_PREC)
                            tl.store(rt + i2 * 0 + 16 + tt[None, :], T21, mask=sel)
                            tl.store(rt + i2 * 0 + tt[None, :], T20, mask=sel)
                        if a == 3:
                            Aa2 = bea[:, None] * kka2 * tl.exp(Ga[:, None] - Gp2[None, :])
                            T20 = tl.load(tb + (i2 + 32) * (H * C) + j2)
                            T21 = tl.load(tb + (i2 + 32) * (H * C) + 16 + j2)
                            T22 = tl.load(tb + (i2 + 32) * (H * C) + 32 + j2)
                            T32 = -tl.dot(Taa, tl.dot(Aa2, T22, input_precision=INV_PREC), input_precision=INV_PREC)
                            T31 = -tl.dot(Taa, tl.dot(Aa2, T21, tl.dot(Aa1, T11, input_precision=INV_PREC),
                                                      input_precision=INV_PREC), input_precision=INV_PREC)
                            X30 = tl.dot(Aa1, T10, tl.dot(Aa0, T00, input_precision=INV_PREC), input_precision=INV_PREC)
                            T30 = -tl.dot(Taa, tl.dot(Aa2, T20, X30, input_precision=INV_PREC), input_precision=INV_PREC)
                            tl.store(rt + i2 * 0 + 32 + tt[None, :], T32, mask=sel)
                            tl.store(rt + i2 * 0 + 16 + tt[None, :], T31, mask=sel)
                            tl.store(rt + i2 * 0 + tt[None, :], T30, mask=sel)
    if DO_T and DO_WM:
        tl.debug_barrier()   # G and row t of T, just stored, are read back below by the other threads
    if DO_WM:
        rows = tl.arange(0, C)
        ok = rows <= t
        rr = tl.arange(0, ROWS)
        wsel = rr[:, None] == t % ROWS
        G = tl.load(gc_ptr + (r0 + rows) * H + h, mask=ok, other=0.0)
        Gt = tl.load(gc_ptr + (r0 + t) * H + h)
        beta = tl.load(b_ptr + (r0 + rows) * H + h, mask=ok, other=0.0)
        Tt = tl.load(tc_ptr + ((r0 + t) * H + h) * C + rr[:, None] * 0 + rows[None, :],
                     mask=wsel, other=0.0).to(OP_DT).to(DOT_DT)
        coef = beta * tl.exp(G)
        wb = w_ptr + (b.to(tl.int64) * H + h) * DKP
        qk = tl.zeros((ROWS, C), dtype=tl.float32)
        for d0 in range(0, DKP, BK):
            dc = d0 + tl.arange(0, BK)
            dm = dc[None, :] < DK
            kraw = tl.load(k_ptr + ((r0 + rows[:, None]) * H + h) * DK + dc[None, :], mask=ok[:, None] & dm,
                           other=0.0).to(tl.float32)
            x = kraw * coef[:, None]
            Wb = tl.dot(Tt, x.to(OP_DT).to(DOT_DT), input_precision=PREC).to(OP_DT)    # [ROWS, BK]
            tl.store(wb + rr[:, None] * 0 + dc[None, :], Wb.to(tl.float32), mask=wsel & dm)
            Q = tl.load(q_ptr + ((r0 + t) * H + h) * DK + rr[:, None] * 0 + dc[None, :], mask=wsel & dm,
                        other=0.0).to(OP_DT).to(DOT_DT)
            qk = tl.dot(Q, tl.trans(kraw.to(OP_DT).to(DOT_DT)), qk, input_precision=PREC)
        incl = wsel & ok[None, :]
        M = tl.where(incl, qk * tl.exp(tl.where(incl, Gt - G[None, :], 0.0)), 0.0)
        tl.store(m_ptr + (b.to(tl.int64) * H + h) * C + rr[:, None] * 0 + rows[None, :], M, mask=wsel)


@jit
def _cpr4_row_kernel(
    q_ptr, v_ptr, b_ptr, gc_ptr, t_ptr, w_ptr, m_ptr, s_ptr, vn_ptr, vnop_ptr, o_ptr, slot_ptr, pos_ptr,
    H, DK, DV,
    C: tl.constexpr, ROWS: tl.constexpr, DKP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    OP_DT: tl.constexpr, DOT_DT: tl.constexpr, PREC: tl.constexpr, S_ONCE: tl.constexpr,
    VN_OP_WRITE: tl.constexpr, VN_OP_READ: tl.constexpr, STACK: tl.constexpr,
):
    # One program per (Dv tile, value head h, lane b). The slot's buffers are token rows
    # [S * C, H, D] (slot s's open chunk: rows s * C ..), the rows of T [S * C, H, C] fp32 and of Vn
    # [S * C, H, Dv] fp32 likewise (and in bf16 where the state keeps the copy); G [S * C, H] from the
    # row-inverse kernel, W_t [B, H, DKP] and M_t [B, H, C] from the W/M kernel; S [slots, H, Dk, Dv]
    # (the slot's boundary, fp32 or its bf16 operand copy). Row t sits
    # at row t % ROWS of ROWS-row operand tiles, the other rows zero (ROWS = C: the native kernels'
    # own tiles).
    vt = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    s = tl.load(slot_ptr + b).to(tl.int64)
    t = tl.load(pos_ptr + b)
    r0 = s * C
    rows = tl.arange(0, C)
    ok = rows <= t
    rr = tl.arange(0, ROWS)
    sel = rr[:, None] == t % ROWS
    # STACK: the rows of U, W and Vn at tile row t + 1 (mod ROWS), q's and the output's at row t, so
    # that W_t S and q_t S come out of one dot with S (each row of a product is computed alone)
    wsel = rr[:, None] == (t + STACK) % ROWS
    dk = tl.arange(0, DKP)
    dv = vt * BV + tl.arange(0, BV)
    km = dk < DK
    vm = dv < DV
    Gt = tl.load(gc_ptr + (r0 + t) * H + h)
    beta = tl.load(b_ptr + (r0 + rows) * H + h, mask=ok, other=0.0)
    # T's row t from the slot's fp32 rows (the W/U kernel rounds T to the operand dtype as it loads it)
    Tt = tl.load(t_ptr + ((r0 + t) * H + h) * C + rr[:, None] * 0 + rows[None, :],
                 mask=wsel, other=0.0).to(OP_DT).to(DOT_DT)
    y = tl.load(v_ptr + ((r0 + rows[:, None]) * H + h) * DV + dv[None, :], mask=ok[:, None] & vm[None, :],
                other=0.0).to(tl.float32) * beta[:, None]
    Ut = tl.dot(Tt, y.to(OP_DT).to(DOT_DT), input_precision=PREC).to(OP_DT)          # [ROWS, BV]
    # Vn_t = U_t - W_t S (the state kernel: one dot over all of Dk), kept unrounded in the slot
    Wt = tl.load(w_ptr + (b.to(tl.int64) * H + h) * DKP + rr[:, None] * 0 + dk[None, :], mask=wsel & km[None, :],
                 other=0.0).to(OP_DT).to(DOT_DT)
    sb = s_ptr + (s * H + h) * (DK * DV)
    S = tl.load(sb + dk[:, None] * DV + dv[None, :], mask=km[:, None] & vm[None, :], other=0.0).to(OP_DT).to(DOT_DT)
    if STACK:
        Q = tl.load(q_ptr + ((r0 + t) * H + h) * DK + rr[:, None] * 0 + dk[None, :], mask=sel & km[None, :],
                    other=0.0).to(OP_DT).to(DOT_DT)
        WQS = tl.dot(tl.where(wsel, Wt, Q), S, input_precision=PREC)   # row t + 1: W_t S; row t: q_t S
        Vt = Ut.to(tl.float32) - WQS
        o = WQS
    else:
        Vt = Ut.to(tl.float32) - tl.dot(Wt, S, input_precision=PREC)
    # o_t as the output kernel: q S over Dk (accumulated in BK blocks there), then the masked,
    # decayed q k^T row (M_t) against Vn in the operand dtype (what the output kernel reads)
    if S_ONCE:
        # one dot over all of Dk from the tile just loaded: the tensor cores chain its k16 steps
        # into the accumulator in Dk order, the accumulations of the BK-block dots in turn (the
        # GEMM's K tiles rest on the same fact); not under the interpreter, whose dots are BLAS
        # calls blocked by shape
        if not STACK:
            Q = tl.load(q_ptr + ((r0 + t) * H + h) * DK + rr[:, None] * 0 + dk[None, :], mask=sel & km[None, :],
                        other=0.0).to(OP_DT).to(DOT_DT)
            o = tl.dot(Q, S, input_precision=PREC)
    else:
        o = tl.zeros((ROWS, BV), dtype=tl.float32)
        for d0 in range(0, DKP, BK):
            dc = d0 + tl.arange(0, BK)
            dm = dc[None, :] < DK
            Q = tl.load(q_ptr + ((r0 + t) * H + h) * DK + rr[:, None] * 0 + dc[None, :], mask=sel & dm,
                        other=0.0).to(OP_DT).to(DOT_DT)
            Sb = tl.load(sb + dc[:, None] * DV + dv[None, :], mask=(dc[:, None] < DK) & vm[None, :],
                         other=0.0).to(OP_DT).to(DOT_DT)
            o = tl.dot(Q, Sb, o, input_precision=PREC)
    vnb = vn_ptr + (r0 * H + h) * DV
    tl.store(vnb + t * (H * DV) + rr[:, None] * 0 + dv[None, :], Vt, mask=wsel & vm[None, :])
    vqb = vnop_ptr + (r0 * H + h) * DV
    if VN_OP_WRITE:   # Vn_t rounded to the operand dtype too, for later steps' outputs
        tl.store(vqb + t * (H * DV) + rr[:, None] * 0 + dv[None, :], Vt.to(vnop_ptr.dtype.element_ty),
                 mask=wsel & vm[None, :])
    tl.debug_barrier()   # row t's Vn, just stored, is read back below by the other threads
    if VN_OP_READ:    # the rows as the output's operand: half the bytes of the unrounded ones
        Vn = tl.load(vqb + rows[:, None] * (H * DV) + dv[None, :], mask=ok[:, None] & vm[None, :], other=0.0)
    else:
        Vn = tl.load(vnb + rows[:, None] * (H * DV) + dv[None, :], mask=ok[:, None] & vm[None, :], other=0.0)
    M = tl.load(m_ptr + (b.to(tl.int64) * H + h) * C + rr[:, None] * 0 + rows[None, :], mask=sel, other=0.0)
    o = o * tl.exp(Gt)
    o = tl.dot(M.to(OP_DT).to(DOT_DT), Vn.to(OP_DT).to(DOT_DT), o, input_precision=PREC)
    tl.store(o_ptr + (b.to(tl.int64) * H + h) * DV + rr[:, None] * 0 + dv[None, :], o, mask=sel & vm[None, :])


@jit
def _cpr4_complete_kernel(
    k_ptr, gc_ptr, s_ptr, sop_ptr, vn_ptr, fill_ptr, slot_ptr, pos_ptr, B, H, DK, DV,
    C: tl.constexpr, DKP: tl.constexpr, BV: tl.constexpr, VT_PER: tl.constexpr, LANES: tl.constexpr,
    OP_DT: tl.constexpr, DOT_DT: tl.constexpr, PREC: tl.constexpr, HAS_OP: tl.constexpr,
):
    # One program per (VT_PER Dv tiles, value head h, LANES lanes), after the row kernel: for each
    # of its lanes b where this step completed the chunk (t = C - 1), the boundary carried across it
    # as the state kernel carries it (the decay on the Vn side from the unrounded Vn rows, k read as
    # it is, the old state as the dot's accumulator), tile by tile; the other lanes are skipped. One
    # lane in C completes a chunk per step, so most programs of a program-per-lane grid had nothing
    # to do, and launching them was most of this kernel's time (0.026 ms a step at 256 lanes on the
    # H200, 1345a25): LANES > 1 and VT_PER > 1 launch fewer. Which program carries a lane changes
    # nothing in its arithmetic. A kernel of its own, not a branch of the row kernel: there its tiles
    # raised the registers of every step (H200, efdb0dd: the row kernel 0.92 ms per step instead of
    # 0.73). The step's last kernel: the head-0, first-tile program of each lane moves its fill on.
    vp = tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.arange(0, C)
    dk = tl.arange(0, DKP)
    km = dk < DK
    # the program's lanes' positions and slots in one load each (not one dependent load a lane)
    lane = tl.arange(0, LANES)
    bs = tl.program_id(2) * LANES + lane
    live = bs < B
    ts = tl.load(pos_ptr + bs, mask=live, other=0)
    ss = tl.load(slot_ptr + bs, mask=live, other=0).to(tl.int64)
    tl.store(fill_ptr + ss, (ts + 1) % C, mask=live & (vp == 0) & (h == 0))
    due = live & (ts == C - 1)
    if tl.sum(due.to(tl.int32), axis=0) > 0:   # most programs: none of their lanes completes
        for li in tl.range(0, LANES, num_stages=1):   # one lane at a time: no software pipelining across lanes
            if tl.sum((due & (lane == li)).to(tl.int32), axis=0) > 0:
                s = tl.sum(tl.where(lane == li, ss, 0), axis=0)
                r0 = s * C
                G = tl.load(gc_ptr + (r0 + rows) * H + h)
                gl = tl.load(gc_ptr + (r0 + C - 1) * H + h)
                Kt = tl.load(k_ptr + ((r0 + rows[None, :]) * H + h) * DK + dk[:, None], mask=km[:, None],
                             other=0.0)
                for j in tl.static_range(VT_PER):
                    dv = (vp * VT_PER + j) * BV + tl.arange(0, BV)
                    vm = dv < DV
                    Vn = tl.load(vn_ptr + ((r0 + rows[:, None]) * H + h) * DV + dv[None, :], mask=vm[None, :],
                                 other=0.0)
                    Vd = Vn * tl.exp(gl - G)[:, None]
                    sp = s_ptr + (s * H + h) * (DK * DV) + dk[:, None] * DV + dv[None, :]
                    S = tl.load(sp, mask=km[:, None] & vm[None, :], other=0.0)
                    Sn = tl.dot(Kt.to(OP_DT).to(DOT_DT), Vd.to(OP_DT).to(DOT_DT), S * tl.exp(gl),
                                input_precision=PREC)
                    tl.store(sp, Sn, mask=km[:, None] & vm[None, :])
                    if HAS_OP:   # the operand copy the row kernel reads (round to nearest even, as torch's)
                        sq = sop_ptr + (s * H + h) * (DK * DV) + dk[:, None] * DV + dv[None, :]
                        tl.store(sq, Sn.to(sop_ptr.dtype.element_ty), mask=km[:, None] & vm[None, :])


def append_token(state: GDNState, q, k, v, g, beta, slots) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per lane written into its slot's open chunk at the slot's fill (q and k repeated
    to the value heads, in fp32; v in the value buffer's dtype); returns (slots, positions) as int64 device tensors.
    ``fill`` itself is left to the caller."""
    check_value_dtype(state, v)
    H = state.buf_k.shape[2]
    sl = slots.to(device=v.device, dtype=torch.long)
    pos = state.fill[sl].long()
    state.buf_q[sl, pos] = _expand_heads(q, H // q.shape[1]).float()
    state.buf_k[sl, pos] = _expand_heads(k, H // k.shape[1]).float()
    state.buf_v[sl, pos] = v.to(state.buf_v.dtype)
    state.buf_g[sl, pos] = g.float()
    state.buf_beta[sl, pos] = beta.float()
    return sl, pos


ROW_TILE = 16
"""Rows of the row kernel's operand tiles on a GPU (row t alone in them, at t % 16). On the H200 at
efdb0dd 16 gave the bits of C-row tiles (0 differing in the probe's three plans and against the
prefix decode) at 1.08 instead of 1.25 ms per decode step. Under the interpreter always C: its dots
are BLAS calls, blocked by shape."""


ROW_WARPS = 4
"""Warps of the row kernel (a row of every product is computed alone: warps change its speed only).
H200 at aa47b16, decode of 256 lanes in graphs: 0.930 ms on 2 warps, 1.024 on 4, 1.325 on 8, each
with the bits of the others and of the prefix decode; again at 77442e3 (W_t and M_t made apart):
0.666 on 2, 0.746 on 4; at a2721da with Dv tiles of 32: 0.648 on 2, 0.597 on 1, against 0.598 for
the pinned 2 warps and Dv tiles of 64. With one dot for W_t S and q_t S (3a08aee): 0.4200 ms on 2
warps and Dv tiles of 64, 0.4098 on 4, 0.4048 on 4 with ``ROW_BV`` = 128 (201 registers, 2 programs
per SM, against 194 and 8 on 2 warps of 64: fewer, fuller programs)."""


ROW_BV = 128
"""Dv tile of the row kernel (all of Qwen3.5's Dv = 128: one program per head and lane, which reads
row t's operands once instead of once per tile). H200 figures: ``ROW_WARPS``."""


WM_WARPS = 2
"""Warps of the W/M kernel (row t of W and of the masked q k^T, once per head and lane). H200 at
77442e3, decode of 256 lanes in graphs: 0.666 ms on 4 warps, 0.673 on 1, the same bits. With
``WM_BK`` = 32 and ``INV_BK`` = 16 (aed6b0b): 0.3852 ms on 2 warps (139 registers, 23 KB of shared
memory a program) against 0.3988 on 4."""


ROW_STACK = True
"""Whether the row kernel takes W_t S and q_t S from one dot with the state tile (W_t at tile row
t + 1 mod ROWS, q_t at row t, so U, W and Vn sit at row t + 1), instead of two dots with it."""


INV_BK = 16
"""Dk block of the row-inverse part's k k^T dots on a GPU (the prefill's BK, 64, or narrower: the
same k16 steps in the same order). The part runs on the inverse kernel's one warp, whose four
16 x BK tiles of k are most of its registers: H200 at aed6b0b (row kernel on ``ROW_BV``), decode
0.4066 ms at 64 (255 registers, 16 spilled), 0.4254 at 32 (6 spilled), 0.3988 at 16 (none); the
same bits in each (0 differing against the trainer in the probe's three plans)."""


WM_BK = 32
"""Dk block of the W/M part on a GPU (W_t's column blocks and the q k^T dots' k16 steps). H200 at
aed6b0b: with ``INV_BK`` = 16 and 2 warps 0.3852 ms against 0.4024 at 64 (4 warps: 0.4158 at 32,
0.4066 at 64), the same bits."""


FUSED_PREP = False
"""Whether the row-inverse and W/M parts of ``_cpr4_row_prep_kernel`` run as one launch (on the
inverse kernel's warps) rather than two (slower on the H200: ``COMPLETE_TILES`` gives the figures)."""


COMPLETE_TILES = 4
"""Dv tiles per program of the completion kernel (its grid covers every lane; one in C completes).
H200 at c158c85, decode of 256 lanes in graphs (Dv 128: four of the fp32 state kernel's 32-wide
tiles): 0.4491 ms at 1, 0.4483 at 2, 0.4441 at 4, the same bits. The row-inverse and W/M parts as
one launch (``FUSED_PREP``) took 0.5193 ms, the same bits."""

COMPLETE_LANES = 8
"""Lanes per program of the completion kernel (a power of two): their positions and slots are read
in one load each, and only a program with a completing lane loops over its lanes (at 1: a program
per lane and head, 8,192 at 256 lanes x 32 heads, most of which only move the fill on). H100 at
c5f7fe1 + this change (``scripts/cpr4_probe.py``, decode of 256 lanes in graphs): 0.4106 ms at 8
against 0.4165 at 1, 0 differing outputs, boundaries and graph replays; ``isoexec bench cpr`` decode
0.4076 ms against 0.4152 before (results/h100/PROVENANCE.md)."""


def check_chunk_form_state(state: GDNState, v: torch.Tensor) -> None:
    """A state version 4 can run on: the open chunk's queries and rows of Vn and T allocated, and
    values of the dtype its buffer keeps (``check_value_dtype``)."""
    if state.buf_q is None or state.buf_vn is None or state.buf_T is None:
        raise ValueError("CPR version 4 needs the open chunk's queries and rows of Vn and T: "
                         "GDNState.allocate(..., with_q=True)")
    check_value_dtype(state, v)


def check_value_dtype(state: GDNState, v: torch.Tensor) -> None:
    """The open chunk's value rows hold v exactly: in fp32, or in v's own dtype where the state keeps
    that (``GDNState.allocate(..., value_dtype=)``); anything else would round v on the way in."""
    if state.buf_v.dtype != torch.float32 and v.dtype != state.buf_v.dtype:
        raise ValueError(f"GDN state keeps the open chunk's values in {state.buf_v.dtype} but v is {v.dtype}: "
                         f"allocate the state with value_dtype={v.dtype} (or float32)")


def cpr4_decode_rows_triton(q, k, v, g, beta, slots, state: GDNState, choice, *, chunk: int = CHUNK,
                            row_tile: int | None = None, row_warps: int | None = None,
                            wm_warps: int | None = None, row_bv: int | None = None,
                            s_once: bool | None = None, fused_prep: bool | None = None,
                            complete_tiles: int | None = None, stack: bool | None = None,
                            inv_bk: int | None = None, wm_bk: int | None = None,
                            complete_lanes: int | None = None) -> torch.Tensor:
    """Engine decode by rows (module docstring), one token per lane; ``choice`` the pinned
    ``NativeWYChoice`` (CPR version 4's); ``row_tile``: rows of the operand tiles (default
    ``ROW_TILE``, at most C); ``row_warps`` / ``wm_warps``: the row and W/M kernels' warps (default
    ``ROW_WARPS`` / ``WM_WARPS``); ``row_bv``: the row kernel's Dv tile (default ``ROW_BV``);
    ``s_once``: the row kernel's q S as one dot over Dk from the state tile it
    already holds (default: on a GPU) instead of BK blocks read again; ``fused_prep``: the row-inverse
    and W/M parts as one launch on the inverse kernel's warps (default ``FUSED_PREP``);
    ``complete_tiles`` / ``complete_lanes``: Dv tiles and lanes per completion program (default
    ``COMPLETE_TILES`` / ``COMPLETE_LANES``); ``stack``: the
    row kernel's W_t S and q_t S as one dot (default ``ROW_STACK``; with ``s_once`` only); ``inv_bk`` /
    ``wm_bk``: the Dk blocks of the row-inverse and W/M parts on a GPU (default ``INV_BK`` / ``WM_BK``,
    at most the choice's BK).
    Appends the token to the slot's open chunk and returns o [B, H, Dv] fp32. No host sync (a CUDA
    graph can capture it); padded lanes point at a scratch slot and touch only that slot."""
    check_chunk_form_state(state, v)
    C = chunk
    lanes = complete_lanes or COMPLETE_LANES
    if lanes < 1 or lanes & (lanes - 1):   # before anything is written to the state
        raise ValueError(f"complete_lanes must be a power of two, got {lanes}")
    B = q.shape[0]
    S_, H, Dk = state.buf_k.shape[0], state.buf_k.shape[2], state.buf_k.shape[3]
    Dv = state.buf_v.shape[3]
    dev = v.device
    OP_DT, DOT_DT, PREC, st_dt = _dtypes(choice.dot)
    num = dict(OP_DT=OP_DT, DOT_DT=DOT_DT, PREC=PREC)
    DKP, DVP = max(16, next_pow2(Dk)), max(16, next_pow2(Dv))
    BK = min(choice.bk, DKP, DVP)
    BV = min(row_bv or ROW_BV, DVP)
    rows = C if interpreting() else min(row_tile or ROW_TILE, C)
    s_once = (not interpreting()) if s_once is None else bool(s_once)
    bq, bk = state.buf_q.view(-1, H, Dk), state.buf_k.view(-1, H, Dk)
    bv, bg, bb = state.buf_v.view(-1, H, Dv), state.buf_g.view(-1, H), state.buf_beta.view(-1, H)
    # 0. the token into its slot's open chunk; its position in pos32
    sl = slots.to(device=dev, dtype=torch.int32)
    pos32 = torch.empty(B, dtype=torch.int32, device=dev)
    _cpr4_append_kernel[(H, B)](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), bq, bk, bv, bg, bb,
        state.fill, sl, pos32, H, H // q.shape[1], H // k.shape[1], Dk, Dv, C=C, DKP=DKP, DVP=DVP, num_warps=1)
    # 1. G over the rows so far and row t of T (the earlier rows kept in the slot); 2. row t of W and
    # of the masked q k^T (once per head, not per Dv tile): one kernel, two launches or one
    gc = torch.empty(S_ * C, H, dtype=torch.float32, device=dev)
    w_t = torch.empty(B, H, DKP, dtype=torch.float32, device=dev)
    m_t = torch.empty(B, H, C, dtype=torch.float32, device=dev)
    prep = dict(C=C, NB=C // 16, ROWS=rows, DKP=DKP, INV_PREC=choice.inv_dot, **num)
    args = (bq, bk, bg, bb, gc, state.buf_T, w_t, m_t, sl, pos32, H, Dk)
    fused = FUSED_PREP if fused_prep is None else bool(fused_prep)
    if fused:
        _cpr4_row_prep_kernel[(H, B)](*args, **prep, BK=BK, DO_T=True, DO_WM=True, num_warps=choice.prep_warps)
    else:
        # each part's Dk blocks may be narrower than the prefill's BK on a GPU, where a dot chained
        # over two blocks of Dk is the same sequence of k16 steps as one over both (not under the
        # interpreter, whose dots are BLAS calls blocked by shape)
        bk_t, bk_w = (BK, BK) if interpreting() else (min(inv_bk or INV_BK, BK), min(wm_bk or WM_BK, BK))
        _cpr4_row_prep_kernel[(H, B)](*args, **prep, BK=bk_t, DO_T=True, DO_WM=False, num_warps=choice.prep_warps)
        _cpr4_row_prep_kernel[(H, B)](*args, **prep, BK=bk_w, DO_T=False, DO_WM=True, num_warps=wm_warps or WM_WARPS)
    # 3. row t of U, Vn and o. The state and the open chunk's Vn rows are read as their operand
    # copies where the state keeps them (allocated together, ``with_q``; the same values: the kernel
    # rounds the fp32 ones to the operand dtype as it loads them). Not under the interpreter, whose
    # conversion truncates where torch's (the copies made by prefill) and a GPU's round to nearest
    # even; the kernels keep the copies up to date either way
    copies = state.boundary_op is not None and state.boundary_op.dtype == st_dt
    read_copies = copies and not interpreting()
    s_op = state.boundary_op if copies else state.boundary
    vn_op = state.buf_vn_op if copies else state.buf_vn
    o = torch.empty(B, H, Dv, dtype=torch.float32, device=dev)
    grid = (-(-Dv // BV), H, B)
    _cpr4_row_kernel[grid](
        bq, bv, bb, gc, state.buf_T, w_t, m_t, s_op if read_copies else state.boundary, state.buf_vn, vn_op,
        o, sl, pos32, H, Dk, Dv,
        C=C, ROWS=rows, DKP=DKP, BK=BK, BV=BV, **num, S_ONCE=s_once, VN_OP_WRITE=copies,
        VN_OP_READ=read_copies, STACK=int(ROW_STACK if stack is None else stack) if s_once else 0, num_warps=row_warps or ROW_WARPS)
    # 4. the boundary where the chunk completes (the state kernel's Dv tile and warps)
    sbv = state_tile(choice, torch.float32, DVP)
    n_vt = -(-Dv // sbv)
    per = min(complete_tiles or COMPLETE_TILES, n_vt)
    lanes = min(lanes, next_pow2(B))
    _cpr4_complete_kernel[(-(-n_vt // per), H, -(-B // lanes))](
        bk, gc, state.boundary, s_op, state.buf_vn, state.fill, sl, pos32,
        B, H, Dk, Dv, C=C, DKP=DKP, BV=sbv, VT_PER=per, LANES=lanes, **num, HAS_OP=copies,
        num_warps=choice.state_warps)
    return o


__all__ = ["COMPLETE_LANES", "COMPLETE_TILES", "FUSED_PREP", "INV_BK", "ROW_BV", "ROW_STACK", "ROW_TILE", "ROW_WARPS", "WM_BK", "WM_WARPS", "append_token", "check_chunk_form_state",
           "check_value_dtype",
           "cpr4_decode_rows_triton"]
