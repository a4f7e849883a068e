"""CPR version 4's decode by rows (work in progress, not pinned): one token per lane, row t of the
chunk form alone instead of the whole open chunk (docs/cpr.md, "The row-only decode").

The prefix decode (``cpr_chunk.cpr4_decode_prefix_triton``) runs the four native WY kernels on the
open chunk's rows so far at every step and keeps the last row. Here a step at in-chunk position t
runs three kernels:

1. the inverse kernel on the rows so far (G and T = (I + A)^-1 for rows 0..t: small, 64 x 64 per
   head, and it is prefill's own kernel, so row t of T has prefill's bits);
2. ``_cpr4_row_kernel``, one program per (Dv tile, value head, lane), with the native kernels'
   operations for row t only, each dot with row t alone in its operand tile (the other rows zero):
   W_t = r(T_t) r(k beta e^G) and U_t = r(T_t) r(v beta) as the W/U kernel (which stores them in
   bf16), Vn_t = U_t - r(W_t) r(S) as the state kernel (S the slot's fp32 ``boundary``, the state
   entering the open chunk), kept unrounded in the slot's ``buf_vn``, then
   o_t = e^{G_t} (r(q_t) r(S)) + r(M_t) r(Vn) with M_tj = (q_t . k_j) e^{G_t - G_j} (j <= t) as the
   output kernel, its q dots over Dk in the same BK blocks, Vn's rows j < t read from ``buf_vn``,
   where earlier steps (or the prefill that opened the chunk) left them;
3. ``_cpr4_complete_kernel``: where the step completes the chunk (t = C - 1), ``boundary`` carried
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
differing outputs against the trainer and against the prefix decode. Rounding schedule: the native kernels' "bf16" mode (``native_wy.py``): bf16
operands, fp32 accumulation, W and U rounded to bf16 before use, Vn rounded to bf16 as an operand
of the output (and kept unrounded for the state), the state in fp32.

Cost per step: the boundary state read once per lane (as native decode reads its state, and written
back where the chunk completes), the open chunk's buffered rows, and the inverse.
"""

from __future__ import annotations

import torch

from .._triton_util import interpreting, jit, next_pow2, tl
from .native_wy import _dtypes, launch_inverse, state_tile
from .reference import _expand_heads
from .state import CHUNK, GDNState


@jit
def _cpr4_row_kernel(
    q_ptr, k_ptr, v_ptr, b_ptr, gc_ptr, t_ptr, s_ptr, vn_ptr, o_ptr, slot_ptr, pos_ptr,
    H, DK, DV,
    C: tl.constexpr, ROWS: tl.constexpr, DKP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    OP_DT: tl.constexpr, DOT_DT: tl.constexpr, PREC: tl.constexpr,
):
    # One program per (Dv tile, value head h, lane b). The slot's buffers are token rows
    # [S * C, H, D] (slot s's open chunk: rows s * C ..), T is the inverse kernel's [B, H, C, C] for
    # lane b's rows so far, G its [S * C, H]; S [slots, H, Dk, Dv] fp32 (the slot's boundary); the
    # slot's Vn rows [S * C, H, Dv] fp32. Row t sits at row t % ROWS of ROWS-row operand tiles, the
    # other rows zero (ROWS = C: the native kernels' own tiles).
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
    dk = tl.arange(0, DKP)
    dv = vt * BV + tl.arange(0, BV)
    km = dk < DK
    vm = dv < DV
    G = tl.load(gc_ptr + (r0 + rows) * H + h, mask=ok, other=0.0)
    Gt = tl.load(gc_ptr + (r0 + t) * H + h)
    beta = tl.load(b_ptr + (r0 + rows) * H + h, mask=ok, other=0.0)
    # T's row t (the W/U kernel reads T in its bf16 storage, then as the operand dtype)
    Tt = tl.load(t_ptr + ((b.to(tl.int64) * H + h) * C + t) * C + rr[:, None] * 0 + rows[None, :],
                 mask=sel, other=0.0).to(OP_DT).to(DOT_DT)
    # W_t over all of Dk (the W/U kernel's column blocks of BK are independent dots over C)
    kraw = tl.load(k_ptr + ((r0 + rows[:, None]) * H + h) * DK + dk[None, :], mask=ok[:, None] & km[None, :],
                   other=0.0)
    x = kraw.to(tl.float32) * (beta * tl.exp(G))[:, None]
    Wt = tl.dot(Tt, x.to(OP_DT).to(DOT_DT), input_precision=PREC).to(OP_DT)          # [ROWS, DKP]
    y = tl.load(v_ptr + ((r0 + rows[:, None]) * H + h) * DV + dv[None, :], mask=ok[:, None] & vm[None, :],
                other=0.0).to(tl.float32) * beta[:, None]
    Ut = tl.dot(Tt, y.to(OP_DT).to(DOT_DT), input_precision=PREC).to(OP_DT)          # [ROWS, BV]
    # Vn_t = U_t - W_t S (the state kernel: one dot over all of Dk), kept unrounded in the slot
    sb = s_ptr + (s * H + h) * (DK * DV)
    S = tl.load(sb + dk[:, None] * DV + dv[None, :], mask=km[:, None] & vm[None, :], other=0.0)
    Vt = Ut.to(tl.float32) - tl.dot(Wt.to(DOT_DT), S.to(OP_DT).to(DOT_DT), input_precision=PREC)
    vnb = vn_ptr + (r0 * H + h) * DV
    tl.store(vnb + t * (H * DV) + rr[:, None] * 0 + dv[None, :], Vt, mask=sel & vm[None, :])
    tl.debug_barrier()   # row t's Vn, just stored, is read back below by the other threads
    Vn = tl.load(vnb + rows[:, None] * (H * DV) + dv[None, :], mask=ok[:, None] & vm[None, :], other=0.0)
    # o_t as the output kernel: q S and q k^T over Dk in blocks of BK, accumulated in order, then
    # the masked, decayed q k^T row against Vn in the operand dtype (what the output kernel reads)
    qk = tl.zeros((ROWS, C), dtype=tl.float32)
    o = tl.zeros((ROWS, BV), dtype=tl.float32)
    for d0 in range(0, DKP, BK):
        dc = d0 + tl.arange(0, BK)
        dm = dc[None, :] < DK
        Q = tl.load(q_ptr + ((r0 + t) * H + h) * DK + rr[:, None] * 0 + dc[None, :], mask=sel & dm,
                    other=0.0).to(OP_DT).to(DOT_DT)
        K = tl.load(k_ptr + ((r0 + rows[:, None]) * H + h) * DK + dc[None, :], mask=ok[:, None] & dm,
                    other=0.0).to(OP_DT).to(DOT_DT)
        Sb = tl.load(sb + dc[:, None] * DV + dv[None, :], mask=(dc[:, None] < DK) & vm[None, :],
                     other=0.0).to(OP_DT).to(DOT_DT)
        qk = tl.dot(Q, tl.trans(K), qk, input_precision=PREC)
        o = tl.dot(Q, Sb, o, input_precision=PREC)
    incl = sel & ok[None, :]
    M = tl.where(incl, qk * tl.exp(tl.where(incl, Gt - G[None, :], 0.0)), 0.0)
    o = o * tl.exp(Gt)
    o = tl.dot(M.to(OP_DT).to(DOT_DT), Vn.to(OP_DT).to(DOT_DT), o, input_precision=PREC)
    tl.store(o_ptr + (b.to(tl.int64) * H + h) * DV + rr[:, None] * 0 + dv[None, :], o, mask=sel & vm[None, :])


@jit
def _cpr4_complete_kernel(
    k_ptr, gc_ptr, s_ptr, vn_ptr, slot_ptr, pos_ptr, H, DK, DV,
    C: tl.constexpr, DKP: tl.constexpr, BV: tl.constexpr,
    OP_DT: tl.constexpr, DOT_DT: tl.constexpr, PREC: tl.constexpr,
):
    # One program per (Dv tile, value head h, lane b), after the row kernel: where this step
    # completed the chunk (t = C - 1), the boundary carried across it as the state kernel carries it
    # (the decay on the Vn side from the unrounded Vn rows, k read as it is, the old state as the
    # dot's accumulator); every other program returns at once. A kernel of its own, not a branch of
    # the row kernel: there its tiles raised the registers of every step (H200, efdb0dd: the row
    # kernel 0.92 ms per step instead of 0.73).
    vt = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    t = tl.load(pos_ptr + b)
    if t != C - 1:
        return
    s = tl.load(slot_ptr + b).to(tl.int64)
    r0 = s * C
    rows = tl.arange(0, C)
    dk = tl.arange(0, DKP)
    dv = vt * BV + tl.arange(0, BV)
    km = dk < DK
    vm = dv < DV
    G = tl.load(gc_ptr + (r0 + rows) * H + h)
    gl = tl.load(gc_ptr + (r0 + C - 1) * H + h)
    Vn = tl.load(vn_ptr + ((r0 + rows[:, None]) * H + h) * DV + dv[None, :], mask=vm[None, :], other=0.0)
    Vd = Vn * tl.exp(gl - G)[:, None]
    Kt = tl.load(k_ptr + ((r0 + rows[None, :]) * H + h) * DK + dk[:, None], mask=km[:, None], other=0.0)
    sp = s_ptr + (s * H + h) * (DK * DV) + dk[:, None] * DV + dv[None, :]
    S = tl.load(sp, mask=km[:, None] & vm[None, :], other=0.0)
    Sn = tl.dot(Kt.to(OP_DT).to(DOT_DT), Vd.to(OP_DT).to(DOT_DT), S * tl.exp(gl), input_precision=PREC)
    tl.store(sp, Sn, mask=km[:, None] & vm[None, :])


def append_token(state: GDNState, q, k, v, g, beta, slots) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per lane written into its slot's open chunk at the slot's fill (q and k repeated
    to the value heads, every buffer fp32); returns (slots, positions) as int64 device tensors.
    ``fill`` itself is left to the caller."""
    H = state.buf_k.shape[2]
    sl = slots.to(device=v.device, dtype=torch.long)
    pos = state.fill[sl].long()
    state.buf_q[sl, pos] = _expand_heads(q, H // q.shape[1]).float()
    state.buf_k[sl, pos] = _expand_heads(k, H // k.shape[1]).float()
    state.buf_v[sl, pos] = v.float()
    state.buf_g[sl, pos] = g.float()
    state.buf_beta[sl, pos] = beta.float()
    return sl, pos


ROW_TILE = 16
"""Rows of the row kernel's operand tiles on a GPU (row t alone in them, at t % 16). On the H200 at
efdb0dd 16 gave the bits of C-row tiles (0 differing in the probe's three plans and against the
prefix decode) at 1.08 instead of 1.25 ms per decode step. Under the interpreter always C: its dots
are BLAS calls, blocked by shape."""


ROW_WARPS = 2
"""Warps of the row kernel (a row of every product is computed alone: warps change its speed only).
H200 at aa47b16, decode of 256 lanes in graphs: 0.930 ms on 2 warps, 1.024 on 4, 1.325 on 8, each
with the bits of the others and of the prefix decode."""


def cpr4_decode_rows_triton(q, k, v, g, beta, slots, state: GDNState, choice, *, chunk: int = CHUNK,
                            row_tile: int | None = None, row_warps: int | None = None) -> torch.Tensor:
    """Engine decode by rows (module docstring), one token per lane; ``choice`` the pinned
    ``NativeWYChoice`` (CPR version 4's); ``row_tile``: rows of the operand tiles (default
    ``ROW_TILE``, at most C); ``row_warps``: the row kernel's warps (default ``ROW_WARPS``).
    Appends the token to the slot's open chunk and returns o [B, H, Dv] fp32. No host sync (a CUDA
    graph can capture it); padded lanes point at a scratch slot and touch only that slot."""
    if state.buf_vn is None:
        raise ValueError("CPR version 4 needs the open chunk's queries and Vn rows: "
                         "GDNState.allocate(..., with_q=True)")
    C = chunk
    B = q.shape[0]
    S_, H, Dk = state.buf_k.shape[0], state.buf_k.shape[2], state.buf_k.shape[3]
    Dv = state.buf_v.shape[3]
    dev = v.device
    sl, pos = append_token(state, q, k, v, g, beta, slots)
    OP_DT, DOT_DT, PREC, st_dt = _dtypes(choice.dot)
    num = dict(OP_DT=OP_DT, DOT_DT=DOT_DT, PREC=PREC)
    DKP, DVP = max(16, next_pow2(Dk)), max(16, next_pow2(Dv))
    BK = min(choice.bk, DKP, DVP)
    BV = min(choice.out_bv, DVP)
    rows = C if interpreting() else min(row_tile or ROW_TILE, C)
    bk, bg, bb = state.buf_k.view(-1, H, Dk), state.buf_g.view(-1, H), state.buf_beta.view(-1, H)
    # 1. G and T over each lane's rows so far
    gc, Tm = launch_inverse(bk, bg, bb, (sl * C).to(torch.int32), (pos + 1).to(torch.int32), S_ * C, H, 1, C, BK,
                            num, st_dt, choice.inv_dot, choice.prep_warps)
    # 2. row t of W, U, Vn and o
    o = torch.empty(B, H, Dv, dtype=torch.float32, device=dev)
    pos32 = pos.to(torch.int32)
    grid = (-(-Dv // BV), H, B)
    _cpr4_row_kernel[grid](
        state.buf_q.view(-1, H, Dk), bk, state.buf_v.view(-1, H, Dv), bb, gc, Tm, state.boundary, state.buf_vn,
        o, sl, pos32, H, Dk, Dv,
        C=C, ROWS=rows, DKP=DKP, BK=BK, BV=BV, **num, num_warps=row_warps or ROW_WARPS)
    # 3. the boundary where the chunk completes (the state kernel's Dv tile and warps)
    sbv = state_tile(choice, torch.float32, DVP)
    _cpr4_complete_kernel[(-(-Dv // sbv), H, B)](
        bk, gc, state.boundary, state.buf_vn, sl, pos32, H, Dk, Dv,
        C=C, DKP=DKP, BV=sbv, **num, num_warps=choice.state_warps)
    state.fill[sl] = ((pos + 1) % C).to(state.fill.dtype)
    return o


__all__ = ["ROW_TILE", "ROW_WARPS", "append_token", "cpr4_decode_rows_triton"]
