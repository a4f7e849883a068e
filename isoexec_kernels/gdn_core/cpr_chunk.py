"""CPR version 4 (impl ``gdn_cpr_chunk``): every output from the chunk form, on the native WY kernels
(docs/cpr.md, "Next: outputs in the chunk form").

Version 3 takes each output inside a chunk from a 64-step per-token recurrence; here every case
computes the chunk form of ``native_wy.py`` (inverse, W/U, state pass, output kernel) with the
operands pinned by v's dtype (``cpr4_choice``: bf16 operands for bf16 values, tf32x3 dots for fp32
ones), so that trainer, engine prefill split anywhere and engine decode give each token the same bits:

* trainer: the native forward over each sequence from the zero state;
* engine prefill: each piece runs as [the open chunk's buffered rows + the new rows] from the fp32
  state entering the open chunk (the slot's ``boundary``), so its chunks are the trainer's chunks
  and the state pass continues the trainer's chain from the same fp32 value; the state entering the
  new open chunk is read from the state pass (stored in fp32), or is the final state when the piece
  ends on a chunk boundary;
* engine decode: the token is appended to the slot's buffer and the native forward runs on the open
  chunk's rows so far (fill + 1 rows) from ``boundary``; the output is its last row; when the chunk
  completes, the state pass's final state becomes the new ``boundary``.

Why the bits agree: row t of every matrix of the chunk form depends only on rows 0..t of its chunk
(causal mask, lower-triangular inverse, ``tl.cumsum``'s prefix), so a prefix of a chunk gives its
rows the bits of the whole chunk: on the H200 0 of 128 prefixes differed through these kernels
(``scripts/chunk_prefix_probe.py``, bf16 and tf32x3, zero and random start states). The chain
resumed from a stored fp32 state continues with the values it carries in registers.

Decode by rows (``cpr_row_decode.py``) computes row t of the chunk form alone; the prefix decode
(``cpr4_decode_prefix_triton``) recomputes the whole open chunk every step (the first correct
version, 5.5x native decode on the H200 at ``fc3181a``) and is kept as its yardstick.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .native_wy import (NativeWYChoice, WYParts, _dtypes, launch_inverse_wu, launch_wy_out, launch_wy_state,
                        next_pow2, state_tile, wy_chunk_triton, wy_forward_parts)
from .cpr_row_decode import append_token, check_chunk_form_state, cpr4_decode_rows_triton
from .._triton_util import int32_segments, interpreting
from .plan import HostPlan, _virtual_rows, engine_layout
from .reference import _expand_heads
from .state import CHUNK, GDNState

CPR4_CHOICE = NativeWYChoice(dot="bf16", prep_warps=1)
"""The native kernels' tiles with bf16 operands (fp32 accumulation, fp32 state chain), for values
that are not fp32, and the inverse kernel on one warp: its 15-step substitution reduces 16 x 16
tiles, within one warp by shuffles (H200 at df9bebd, ``scripts/cpr4_probe.py --sweep``: decode by
rows 1.14 ms instead of 1.43 at 256 lanes, trainer forward 1.07 instead of 1.20 ms, prefill 2.11
instead of 2.25 ms, 0 differing in each)."""

CPR4_CHOICE_FP32 = replace(CPR4_CHOICE, dot="tf32x3")
"""The same tiles for fp32 values: fp32-accurate dots (three TF32 products each, as version 3's), so
that an fp32 model keeps fp32 accuracy (bf16 operands gave an fp32 hybrid 2.7e-5 logprob error
against transformers' instead of 1e-5; and a rounding to bf16 turns fp32 noise from elsewhere, such
as a sharded reduction's order, into whole bf16 steps)."""


def cpr4_choice(value_dtype: torch.dtype) -> NativeWYChoice:
    """Version 4's pinned numerics for values of ``value_dtype`` (the model's dtype, fixed by the
    contract): ``CPR4_CHOICE_FP32`` for fp32, ``CPR4_CHOICE`` (bf16 operands) otherwise."""
    return CPR4_CHOICE_FP32 if value_dtype == torch.float32 else CPR4_CHOICE


def cpr4_varlen_triton(q, k, v, g, beta, cu_seqlens, *, chunk: int = CHUNK) -> torch.Tensor:
    """Trainer: each sequence of ``cu_seqlens`` from the zero state; o [T, H, Dv] fp32."""
    cu = cu_seqlens.tolist()
    starts, lens = cu[:-1], [b - a for a, b in zip(cu[:-1], cu[1:])]
    return wy_chunk_triton(q, k, v, g, beta, starts, lens, None, None, None, chunk, cpr4_choice(v.dtype),
                           states_dtype=torch.float32)


def refresh_boundary_op(state: GDNState, slots: torch.Tensor) -> None:
    """``boundary_op`` of ``slots`` from their fp32 ``boundary`` (torch's round to nearest even, the
    kernels' conversion too), where the state keeps one."""
    if state.boundary_op is not None:
        state.boundary_op[slots] = state.boundary[slots].to(state.boundary_op.dtype)


def _expand(x: torch.Tensor, H: int) -> torch.Tensor:
    """[N, Hk, D] keys or queries repeated to the H value heads ([N, H, D])."""
    return _expand_heads(x, H // x.shape[1])


def _forward_triton(pq, pk, pv, pg, pb, starts, lens, init, C, *, slot_state=None):
    """The chunk form over pieces (rows ``starts[b]..+lens[b]``, piece b from ``init[b]``): o [rows,
    H, Dv] fp32, the fp32 state entering each chunk [P, H, Dk, Dv] (None without a chunk), each
    piece's final state [B, H, Dk, Dv] (unwritten for an empty piece), Vn [P, H, C, Dv] and T
    [P, H, C, C] in fp32, unrounded (None without a chunk).

    ``slot_state`` = (state, slots, ends): the engine's form (``engine_step``), ``init`` unused: piece
    b starts from the slot's ``boundary`` read in place, and where ``ends[b]`` (the piece ends on a
    chunk boundary) its final state is written straight into the slot's ``boundary`` (and its bf16
    ``boundary_op``, on a GPU) instead of returned: three to six torch operations fewer per call,
    which is what a prefill's wall time is made of on a slow host. The returned final states are
    then None."""
    H, Dk, Dv = pv.shape[1], pk.shape[2], pv.shape[2]
    B = len(lens)
    fp32 = dict(states_dtype=torch.float32, vn_dtype=torch.float32, t_dtype=torch.float32)
    if slot_state is None:
        fin = torch.empty(B, H, Dk, Dv, dtype=torch.float32, device=pv.device)
        f = wy_forward_parts(pq, pk, pv, pg, pb, starts, lens, init, fin, list(range(B)), C,
                             cpr4_choice(pv.dtype), **fp32)
    else:
        state, slots, at_end = slot_state
        fin = None
        fin_idx = [s if e else -1 for s, e in zip(slots, at_end)]
        # the operand copy by the state kernel's store (a GPU's conversion rounds to nearest even,
        # as torch's does; the interpreter's truncates, so there ``refresh_boundary_op`` makes it)
        op = state.boundary_op if not interpreting() else None
        f = wy_forward_parts(pq, pk, pv, pg, pb, starts, lens, state.boundary, state.boundary, fin_idx, C,
                             cpr4_choice(pv.dtype), **fp32, init_idx=list(slots), fin2=op,
                             fin2_idx=fin_idx if op is not None else None)
    o = torch.empty(pk.shape[0], H, Dv, dtype=torch.float32, device=pv.device)
    if f is None:
        return o, None, fin, None, None
    launch_wy_out(pq, f, o, C)
    return o, f.states, fin, f.vn, f.T


_forward_triton.slot_state = True   # engine_step may hand it the slots' states to read and write in place


def engine_step(q, k, v, g, beta, cu_seqlens_q, slots, state: GDNState, chunk: int, forward,
                host: HostPlan | None = None) -> torch.Tensor:
    """The engine prefill of version 4 on a chunk-form ``forward`` (``_forward_triton`` or the
    reference's): sequence b's new rows continue slot ``slots[b]`` (module docstring); updates
    ``state`` (boundary, the open chunk's buffers and rows of Vn and T, fill) and returns o [T, H, Dv] fp32
    for the new rows. Host-side planning: the prefill path, not the captured decode. ``host``: the
    layout as the engine knows it (``plan.HostPlan``); without it the layout is read back from the
    device. Either way a fixed number of tensor operations, whatever the number of sequences."""
    check_chunk_form_state(state, v)
    C = chunk
    H, Dv = v.shape[1], v.shape[2]
    dev = v.device
    new_starts, new_lens, sl, fills = engine_layout(host, cu_seqlens_q, slots, state, C, q.shape[0],
                                                    "gdn_cpr4_engine")
    # pieces in the inputs' layout (q and k on their Hk heads, q, k and v in their dtypes: the kernels
    # read them so, as the trainer's do); the buffered rows go back to it exactly (the buffers hold
    # the values of those dtypes in fp32, or v's in its own, the key heads repeated to the value heads)
    rep = H // k.shape[1]
    dtypes = (q.dtype, k.dtype, v.dtype, torch.float32, torch.float32)
    news = (q, k, v, g, beta)
    fresh = not any(fills)
    if fresh:
        # every slot fresh (a new prompt's prefill): the pieces are the new rows as they are, and so
        # is the output (no copies)
        starts, lens, gather = new_starts, new_lens, []
    else:
        # piece b = slot b's buffered rows, then sequence b's new rows (plan._virtual_rows)
        starts, lens, new_dst, _, pre_dst, pre_slot, pre_pos = _virtual_rows(state, sl, fills, new_starts, new_lens, C)
        gather = [new_dst, pre_dst, pre_slot, pre_pos]
    # what each slot keeps, planned on the host and written by one indexing operation per buffer:
    # the boundary (the final state where the piece ends on a chunk boundary, else the state entering
    # its last, open chunk), the open chunk's last L % C rows and their rows of Vn and T, the fill
    fin_b, fin_s, st_i, st_s, src, dst_s, dst_p, ch = [], [], [], [], [], [], [], []
    first = 0
    for b, s in enumerate(sl):
        L = lens[b]
        nch = -(-L // C)
        if L and L % C == 0:
            fin_b.append(b)
            fin_s.append(s)
        elif L:
            st_i.append(first + nch - 1)
            st_s.append(s)
        first += nch
        r = L % C
        if r:
            a0 = starts[b] + L - r
            src += range(a0, a0 + r)
            dst_s += [s] * r
            dst_p += range(r)
            ch += [first - 1] * r
    segs = int32_segments([sl, [L % C for L in lens], fin_b, fin_s, st_i, st_s, src, dst_s, dst_p, ch] + gather, dev)
    (sl_t, fill_t, fin_b_t, fin_s_t, st_i_t, st_s_t, src_t, dst_s_t, dst_p_t, ch_t) = segs[:10]
    if fresh:
        pq, pk, pv, pg, pb = (x.to(dt) for x, dt in zip(news, dtypes))
    else:
        nd, pd, ps, pp = segs[10:]
        rows = sum(lens)
        bufs = (state.buf_q[:, :, ::rep], state.buf_k[:, :, ::rep], state.buf_v, state.buf_g, state.buf_beta)
        pieces = []
        for buf, new, dt in zip(bufs, news, dtypes):
            piece = torch.empty((rows,) + tuple(new.shape[1:]), dtype=dt, device=dev)
            piece[nd] = new.to(dt)
            piece[pd] = buf[ps, pp].to(dt)
            pieces.append(piece)
        pq, pk, pv, pg, pb = pieces
    if getattr(forward, "slot_state", False):
        # the slots' boundaries read and (for pieces ending on a chunk boundary) written in place:
        # one kernel reads and writes them, which is race-free only with a slot per sequence
        if len(set(sl)) != len(sl):
            raise ValueError(f"gdn_cpr4_engine: each sequence needs a state slot of its own; got slots {list(sl)}")
        ends = [bool(L) and L % C == 0 for L in lens]
        o_all, states, _, vn, tm = forward(pq, pk, pv, pg, pb, starts, lens, None, C, slot_state=(state, sl, ends))
        if st_i:
            state.boundary[st_s_t] = states[st_i_t]
        if state.boundary_op is not None and (interpreting() or st_i):
            refresh_boundary_op(state, sl_t if interpreting() else st_s_t)
    else:
        init = state.boundary[sl_t]
        o_all, states, fin, vn, tm = forward(pq, pk, pv, pg, pb, starts, lens, init, C)
        if fin_b:
            state.boundary[fin_s_t] = fin[fin_b_t]
        if st_i:
            state.boundary[st_s_t] = states[st_i_t]
        refresh_boundary_op(state, sl_t)
    if src:
        for buf, piece, heads in ((state.buf_q, pq, True), (state.buf_k, pk, True), (state.buf_v, pv, False),
                                  (state.buf_g, pg, False), (state.buf_beta, pb, False)):
            rows = piece[src_t]
            buf[dst_s_t, dst_p_t] = (_expand(rows, H) if heads else rows).to(buf.dtype)
        # the open chunk's (its piece's last chunk's) rows of Vn and T, for the row decode
        vn_rows = vn[ch_t, :, dst_p_t]
        state.buf_vn[dst_s_t, dst_p_t] = vn_rows
        if state.buf_vn_op is not None:   # rounded as the kernels round (to nearest even)
            state.buf_vn_op[dst_s_t, dst_p_t] = vn_rows.to(state.buf_vn_op.dtype)
        state.buf_T[dst_s_t, dst_p_t] = tm[ch_t, :, dst_p_t]
    state.fill[sl_t] = fill_t.to(state.fill.dtype)
    return o_all if fresh else o_all[nd]


def cpr4_engine_triton(q, k, v, g, beta, cu_seqlens_q, slots, state: GDNState, *, chunk: int = CHUNK,
                       host: HostPlan | None = None) -> torch.Tensor:
    """Engine prefill on the native WY kernels (``engine_step``)."""
    return engine_step(q, k, v, g, beta, cu_seqlens_q, slots, state, chunk, _forward_triton, host)


ROW_DECODE_DOTS = ("bf16",)
"""The operand modes whose decode goes by rows. fp32 values (tf32x3) take the prefix decode: on the
H200 at 1f3c6ee the row decode in tf32x3 missed the trainer's bits (22,074-62,239 of 2,043,904
outputs in three plans, every tile variant; 93-247 with q S in BK blocks), where the prefix decode
gave 0 (``scripts/cpr4_probe.py --fp32``). A tf32x3 dot splits each operand into a high and a low
part, three products summed; a row alone in a 16-row tile evidently sums them otherwise than the
64-row tile does, which bf16's single product does not (0 differing in every bf16 probe and gate)."""


def cpr4_decode_triton(q, k, v, g, beta, slots, state: GDNState, *, chunk: int = CHUNK) -> torch.Tensor:
    """Engine decode, one token per lane: by rows, row t of the chunk form alone
    (``cpr_row_decode.py``), for bf16 values; by prefix for fp32 values (``ROW_DECODE_DOTS``);
    o [B, H, Dv] fp32."""
    choice = cpr4_choice(v.dtype)
    if choice.dot not in ROW_DECODE_DOTS:
        return cpr4_decode_prefix_triton(q, k, v, g, beta, slots, state, chunk=chunk)
    return cpr4_decode_rows_triton(q, k, v, g, beta, slots, state, choice, chunk=chunk)


def cpr4_decode_prefix_triton(q, k, v, g, beta, slots, state: GDNState, *, chunk: int = CHUNK) -> torch.Tensor:
    """Engine decode, one token per lane, by prefix (the first correct version, kept as the row
    decode's yardstick on the GPU): appends it to the slot's open chunk and runs the chunk
    form on the chunk's rows so far from ``boundary``; o [B, H, Dv] fp32 is their last row. No host
    sync: the plan (rows, counts, state indices) is computed on the device, so a CUDA graph can
    capture it. Padded lanes point at a scratch slot and touch only that slot. It leaves the
    slot's ``buf_vn`` and ``buf_T`` as they were: a lane must not switch between the two decodes
    inside a chunk."""
    C = chunk
    choice = cpr4_choice(v.dtype)
    B = q.shape[0]
    S_, H, Dk = state.buf_k.shape[0], state.buf_k.shape[2], state.buf_k.shape[3]
    Dv = state.buf_v.shape[3]
    dev = v.device
    sl, pos = append_token(state, q, k, v, g, beta, slots)
    n = pos + 1
    row0 = (sl * C).to(torch.int32)
    nrow = n.to(torch.int32)
    chunk0 = torch.arange(B, dtype=torch.int32, device=dev)
    nchunk = torch.ones(B, dtype=torch.int32, device=dev)
    init_idx = sl.to(torch.int32)
    fin_idx = torch.where(n == C, sl, -1).to(torch.int32)
    bq, bk = state.buf_q.view(-1, H, Dk), state.buf_k.view(-1, H, Dk)
    bv, bg, bb = state.buf_v.view(-1, H, Dv), state.buf_g.view(-1, H), state.buf_beta.view(-1, H)
    OP_DT, DOT_DT, PREC, st_dt = _dtypes(choice.dot)
    num = dict(OP_DT=OP_DT, DOT_DT=DOT_DT, PREC=PREC)
    DKP, DVP = max(16, next_pow2(Dk)), max(16, next_pow2(Dv))
    BK = min(choice.bk, DKP, DVP)
    kc = torch.empty(S_ * C, H, Dk, dtype=st_dt, device=dev)
    gc, Tm, W, U = launch_inverse_wu(bk, bv, bg, bb, row0, nrow, kc, S_ * C, H, 1, C, BK, num, st_dt,
                                      choice.inv_dot, choice.prep_warps, choice.wu_warps)
    states = torch.empty(B, H, Dk, Dv, dtype=torch.float32, device=dev)
    vn = torch.empty(B, H, C, Dv, dtype=st_dt, device=dev)
    # init and fin are the same tensor: each program reads and writes only its own tile
    launch_wy_state(kc, gc, W, U, state.boundary, states, vn, state.boundary, row0, nrow, chunk0, nchunk,
                    init_idx, fin_idx, H, 1, C, DKP, state_tile(choice, st_dt, DVP), num,
                    choice.state_warps, choice.state_stages)
    o_rows = torch.empty(S_ * C, H, Dv, dtype=torch.float32, device=dev)
    dims = dict(T=S_ * C, Hk=H, H=H, Dk=Dk, Dv=Dv, rep=1, DKP=DKP, DVP=DVP, BK=BK)
    launch_wy_out(bq, WYParts(choice, B, B, row0, nrow, chunk0, nchunk, gc, Tm, W, kc, states, vn, num, dims,
                              st_dt), o_rows, C)
    refresh_boundary_op(state, sl)
    state.fill[sl] = (n % C).to(state.fill.dtype)
    return o_rows[sl * C + pos]


__all__ = ["CPR4_CHOICE", "CPR4_CHOICE_FP32", "ROW_DECODE_DOTS", "cpr4_choice", "cpr4_varlen_triton", "cpr4_engine_triton", "cpr4_decode_triton", "cpr4_decode_prefix_triton"]
