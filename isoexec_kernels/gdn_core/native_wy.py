"""The native (stock-style) Gated DeltaNet chunk forward in the WY/UT form, as fast stock kernels
compute it: the trainer and prefill path of ``native.py`` on CUDA (``NATIVE_CHUNK_KIND = "wy"``).

It is a baseline: correct at a stated tolerance and deterministic (same inputs, same bits), NOT
batch invariant and not on the invariant path (CPR's kernels in ``triton_kernels.py`` are).

The function, per sequence piece and value head h (key head ``h // REP``), with chunks of C tokens
cut from the piece's first token (a piece's last chunk may be partial: its missing rows act as
padding with g = beta = k = v = q = 0) and S the fp32 state entering the chunk (the engine slot's
state for a piece's first chunk, zero for a trainer sequence)::

    (a) G     = cumsum(g) within the chunk                          Gl = G at its last row
    (b) A_ij  = beta_i (k_i . k_j) exp(G_i - G_j), j < i, else 0
    (c) T     = (I + A)^-1                        blocked: see below
    (d) W     = T (k * beta e^G)                  U = T (v * beta)
    (e) Vn    = U - W S                           S' = e^Gl S + k^T (Vn * e^(Gl - G))
    (f) o     = e^G * (q S) + (causal(q k^T) * e^(G_i - G_j)) Vn

Blocked inverse (c): I + A is cut into 16 x 16 blocks (C / 16 of them along the diagonal). Each
diagonal block's inverse Ti_a = (I + A_aa)^-1 comes by forward substitution on its 16 rows (15
steps, the C / 16 blocks side by side in one loop); the blocks below the diagonal by block forward
substitution, T_ab = -Ti_a sum_{c=b}^{a-1} A_ac T_cb (a > b), as dots of 16 x 16 tiles. Forward
substitution, not a power series: with repeated keys and beta = 1 the powers of A grow
binomially while (I + A)^-1 stays small, so only substitution keeps fp32 accuracy there.

Kernels (one launch each, chunks of every piece of the batch in one grid):
  ``_wy_inverse_kernel`` one program per (value head, chunk): (a)-(c); stores G [T, H] fp32 and T
                         [P, H, C, C]. The A and T blocks live in registers as C / 16 separate
                         16-row tiles (loaded as such: register tiles cannot be sliced), so no
                         64-step row loop runs over a 64 x 64 tile.
  ``_wy_wu_kernel``      one program per (column block of W or U, value head, chunk): (d) as dots
                         of full C-row tiles; in "bf16" mode it also writes k in bf16 ([T, Hk, Dk],
                         by the first value head of each key head) for the next two kernels, so
                         their k tiles go to shared memory as they are loaded (a tile that must be
                         converted first is staged in registers).
  ``_wy_state_kernel``   one program per (piece, value head, Dv tile): (e), sequential over the
                         piece's chunks (the next chunk's W, U, k and G are prefetched while one is
                         computed); stores the state entering each chunk [P, H, Dk, Dv] and Vn
                         [P, H, C, Dv], and the final state to its engine slot. The decay sits on
                         the Vn side (Vn e^(Gl - G)), so k is read as it is.
  ``_wy_out_kernel``     one program per (Dv tile, value head, chunk): (f), all chunks in parallel.
Each program addresses its rows from one int64 base pointer with int32 offsets inside tiles.

Rounding schedule (``NativeWYChoice.dot``; "auto" = "bf16" when v is bf16/fp16, else "tf32"):
  * "bf16": as stock kernels on bf16 inputs. Every large dot takes bf16 operands (q, k, v, T, W,
    U, S, Vn and the masked q k^T tile rounded to nearest even) and accumulates in fp32. T, W, U,
    k's copy, the entering states and Vn are stored in bf16 (each is only read as a dot operand,
    except U, which is read once into U - W S; stock kernels store it in the input dtype too). G,
    A, the blocked inverse's arithmetic, the decays and the state carried between chunks stay fp32.
  * "tf32" / "tf32x3" / "ieee": fp32 operands with that ``tl.dot`` input precision, every
    intermediate stored in fp32.
  The 16 x 16 merge dots of the inverse take fp32 operands at ``NativeWYChoice.inv_dot`` ("ieee":
  fp32 FMA; 16 x 16 x 16 tiles are too small for tensor cores to matter). Reductions are fixed:
  dots over Dk in blocks of ``bk`` accumulated in order, the chunk chain in chunk order, no
  atomics, tiles and warps fixed by the choice and (Dk, Dv), never by T or the batch.
  Accuracy against the float64 recurrence (tests/kernels/test_gdn_native_wy.py): the fp32 modes
  within fp32 tolerance (1e-5 relative L2; under the interpreter ``tl.dot`` is exact fp32, TF32 on
  a GPU leaves about 1e-3); "bf16" 3.8e-3 relative L2 at Qwen3.5 sizes by the torch twin (tests
  allow 1e-2).

Torch twin: :func:`wy_chunk_torch` (the same decomposition and rounding points in stock torch
ops, padded [B, H, chunks, C, ...] layout, blocked inverse by :func:`blocked_unit_lower_inverse`).

Tiles: ``NativeWYChoice`` (Dk block of the dots, Dv tiles of the state and output kernels, warps
and pipeline stages), pinned per call (no autotune), module constant ``NATIVE_WY``; chosen for
Hopper from ``scripts/native_wy_aot.py`` (sm_90 compile without a GPU: no register spills but a few
bytes in the inverse kernel, shared memory within 227 KB; the state kernel's Dv tile of 32 keeps it
at 184 registers, 64 spills); ``scripts/cpr_variant_sweep.py`` times a few on the GPU. Chunk sizes:
16, 32, 64 (C / 16 diagonal blocks); other sizes take ``native.py``'s legacy chunk path.

Tested in the CPU interpreter (where ``tl.dot`` is numpy's matmul and bf16 operands are fp32 values
cast to bf16 and back, see ``_dtypes``; the interpreter's cast truncates where a GPU rounds to
nearest even), compiled for sm_90 by ``scripts/native_wy_aot.py``, and on the H200 at ``616e196``
(GPU tests; ``results/h200/bench/native_sweep.json``: trainer forward 1.16 ms, prefill 1.21-1.23 ms
at 5 x 2048 tokens, 32 value heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._triton_util import int32_segments, interpreting, jit, next_pow2, tl
from .padding import _prepare, _unpad_seqs
from .plan import chunk_plan
from .state import CHUNK


@dataclass(frozen=True)
class NativeWYChoice:
    """Numerics and tiles of the WY kernels (module docstring). ``dot``: operand precision of the
    large dots ("auto", "bf16", "tf32", "tf32x3", "ieee"); ``inv_dot``: precision of the blocked
    inverse's 16 x 16 merge dots; ``bk``: Dk block of the prep and output dots; ``state_bv`` /
    ``out_bv``: Dv tile of the state and output kernels; warps and stages per kernel (the
    backward's reverse pass takes the state kernel's Dv tile, its dVloc kernel the output kernel's
    tiles; ``dhu_*``, ``dqk_warps``, ``wyb_warps``, ``bwd_stages``: the backward's own kernels)."""

    dot: str = "auto"
    inv_dot: str = "ieee"
    bk: int = 64
    state_bv: int = 64   # 32 until the H200 sweep at 616e196: 64 took fwd+bwd 5.01 -> 4.58 ms
    out_bv: int = 64
    prep_warps: int = 4
    wu_warps: int = 4
    state_warps: int = 4
    out_warps: int = 4
    state_stages: int = 2
    out_stages: int = 2
    dhu_warps: int = 8
    dhu_stages: int = 2
    dqk_warps: int = 8
    wyb_warps: int = 4
    bwd_stages: int = 2


NATIVE_WY = NativeWYChoice()
"""The choice the native chunk path runs (a GPU sweep may swap it for another)."""

WY_CHUNKS = (16, 32, 64)
"""Chunk sizes the WY kernels take (C / 16 diagonal blocks of the inverse, a power of two)."""


FP32_STATE_BV = 32
"""The largest state Dv tile with fp32 storage: compiled for sm_90 (``scripts/native_wy_aot.py
--dot tf32``), the backward's reverse pass at a 64-wide tile needs 279,044 bytes of shared memory
(Hopper has 232,448) and was refused on the H200 at ``e5aa202``; at 32 it needs 221,700."""


def state_tile(choice: NativeWYChoice, st_dt: torch.dtype, DVP: int) -> int:
    """The Dv tile of the state kernel and of the backward's reverse pass: the choice's, capped
    at ``FP32_STATE_BV`` for fp32 storage (the bf16 path keeps the choice's 64)."""
    bv = min(choice.state_bv, DVP)
    return min(bv, FP32_STATE_BV) if st_dt == torch.float32 else bv


def _resolve_dot(choice: NativeWYChoice, v_dtype: torch.dtype) -> str:
    if choice.dot == "auto":
        return "bf16" if v_dtype in (torch.bfloat16, torch.float16) else "tf32"
    return choice.dot


def _dtypes(dot: str):
    """(OP_DT, DOT_DT, PREC, store torch dtype) for a resolved ``dot``. OP_DT is what operands are
    rounded to; DOT_DT what ``tl.dot`` sees: the same on a GPU, fp32 under the interpreter (whose
    ``tl.dot`` does not take bf16; the values are still bf16-rounded)."""
    if dot == "bf16":
        return tl.bfloat16, (tl.float32 if interpreting() else tl.bfloat16), "tf32", torch.bfloat16
    if dot not in ("tf32", "tf32x3", "ieee"):
        raise ValueError(f"NativeWYChoice.dot must be auto, bf16, tf32, tf32x3 or ieee; got {dot!r}")
    return tl.float32, tl.float32, dot, torch.float32


# --------------------------------------------------------------------------- Triton kernels


@jit
def _wy_inverse_kernel(
    k_ptr, g_ptr, b_ptr, row0_ptr, nrow_ptr, gc_ptr, t_ptr,
    H, REP, DK, s_kt, s_kh, s_gt, s_bt,
    C: tl.constexpr, NB: tl.constexpr, DKP: tl.constexpr, BK: tl.constexpr,
    OP_DT: tl.constexpr, DOT_DT: tl.constexpr, PREC: tl.constexpr, INV_PREC: tl.constexpr,
):
    # One program per (value head h, chunk p): G (stored [T, H]) and T = (I + A)^-1 (stored
    # [P, H, C, C] in T's dtype, zero above the block diagonal). The blocks a = 0..NB-1 of 16 rows
    # each are written out one by one (NB is 1, 2 or 4) because Triton register tiles cannot be
    # sliced; W and U are left to ``_wy_wu_kernel``, whose full C-row tiles keep these 16-row
    # tiles (replicated across warps) from sharing registers with the k and v blocks.
    # Addressing (every kernel here): one int64 base pointer per program, int32 offsets in tiles
    # (64-bit pointer tiles would take two registers per element).
    h = tl.program_id(0)
    p = tl.program_id(1)
    n = tl.load(nrow_ptr + p)
    if n == 0:
        # an empty chunk (CPR's decode resync launches one program per lane, and only the lanes
        # whose chunk completed have rows): nothing to compute or store
        return
    r0 = tl.load(row0_ptr + p).to(tl.int64)
    kb = k_ptr + r0 * s_kt + (h // REP) * s_kh
    gb = g_ptr + r0 * s_gt + h
    bb = b_ptr + r0 * s_bt + h
    cb = gc_ptr + r0 * H + h
    t = tl.arange(0, 16)
    i2 = t[:, None]
    j2 = t[None, :]
    eye = tl.where(i2 == j2, 1.0, 0.0)
    strict = j2 < i2
    ok0 = t < n
    # (a) G per 16-row block: a block's cumsum plus the sum of the blocks before it
    g0 = tl.load(gb + t * s_gt, mask=ok0, other=0.0).to(tl.float32)
    be0 = tl.load(bb + t * s_bt, mask=ok0, other=0.0).to(tl.float32)
    G0 = tl.cumsum(g0, axis=0)
    tl.store(cb + t * H, G0, mask=ok0)
    if NB >= 2:
        t1 = t + 16
        ok1 = t1 < n
        g1 = tl.load(gb + t1 * s_gt, mask=ok1, other=0.0).to(tl.float32)
        be1 = tl.load(bb + t1 * s_bt, mask=ok1, other=0.0).to(tl.float32)
        G1 = tl.cumsum(g1, axis=0) + tl.sum(g0, axis=0)
        tl.store(cb + t1 * H, G1, mask=ok1)
    if NB >= 4:
        t2 = t + 32
        t3 = t + 48
        ok2 = t2 < n
        ok3 = t3 < n
        g2 = tl.load(gb + t2 * s_gt, mask=ok2, other=0.0).to(tl.float32)
        g3 = tl.load(gb + t3 * s_gt, mask=ok3, other=0.0).to(tl.float32)
        be2 = tl.load(bb + t2 * s_bt, mask=ok2, other=0.0).to(tl.float32)
        be3 = tl.load(bb + t3 * s_bt, mask=ok3, other=0.0).to(tl.float32)
        s01 = tl.sum(g0, axis=0) + tl.sum(g1, axis=0)
        G2 = tl.cumsum(g2, axis=0) + s01
        G3 = tl.cumsum(g3, axis=0) + (s01 + tl.sum(g2, axis=0))
        tl.store(cb + t2 * H, G2, mask=ok2)
        tl.store(cb + t3 * H, G3, mask=ok3)
    # (b) the blocks of k k^T (b <= a), over Dk in blocks of BK accumulated in order
    kk00 = tl.zeros((16, 16), dtype=tl.float32)
    if NB >= 2:
        kk10 = tl.zeros((16, 16), dtype=tl.float32)
        kk11 = tl.zeros((16, 16), dtype=tl.float32)
    if NB >= 4:
        kk20 = tl.zeros((16, 16), dtype=tl.float32)
        kk21 = tl.zeros((16, 16), dtype=tl.float32)
        kk22 = tl.zeros((16, 16), dtype=tl.float32)
        kk30 = tl.zeros((16, 16), dtype=tl.float32)
        kk31 = tl.zeros((16, 16), dtype=tl.float32)
        kk32 = tl.zeros((16, 16), dtype=tl.float32)
        kk33 = tl.zeros((16, 16), dtype=tl.float32)
    for d0 in tl.static_range(0, DKP, BK):
        dc = d0 + tl.arange(0, BK)
        dm = dc[None, :] < DK
        kp = kb + dc[None, :]
        k0 = tl.load(kp + i2 * s_kt, mask=ok0[:, None] & dm, other=0.0).to(OP_DT).to(DOT_DT)
        kk00 = tl.dot(k0, tl.trans(k0), kk00, input_precision=PREC)
        if NB >= 2:
            k1 = tl.load(kp + t1[:, None] * s_kt, mask=ok1[:, None] & dm, other=0.0).to(OP_DT).to(DOT_DT)
            kk10 = tl.dot(k1, tl.trans(k0), kk10, input_precision=PREC)
            kk11 = tl.dot(k1, tl.trans(k1), kk11, input_precision=PREC)
        if NB >= 4:
            k2 = tl.load(kp + t2[:, None] * s_kt, mask=ok2[:, None] & dm, other=0.0).to(OP_DT).to(DOT_DT)
            k3 = tl.load(kp + t3[:, None] * s_kt, mask=ok3[:, None] & dm, other=0.0).to(OP_DT).to(DOT_DT)
            kk20 = tl.dot(k2, tl.trans(k0), kk20, input_precision=PREC)
            kk21 = tl.dot(k2, tl.trans(k1), kk21, input_precision=PREC)
            kk22 = tl.dot(k2, tl.trans(k2), kk22, input_precision=PREC)
            kk30 = tl.dot(k3, tl.trans(k0), kk30, input_precision=PREC)
            kk31 = tl.dot(k3, tl.trans(k1), kk31, input_precision=PREC)
            kk32 = tl.dot(k3, tl.trans(k2), kk32, input_precision=PREC)
            kk33 = tl.dot(k3, tl.trans(k3), kk33, input_precision=PREC)
    # A blocks: beta_i (k_i . k_j) exp(G_i - G_j); strictly lower inside a diagonal block (the
    # exponent is masked there too: above the diagonal G_i - G_j > 0 could overflow)
    A00 = tl.where(strict, be0[:, None] * kk00 * tl.exp(tl.where(strict, G0[:, None] - G0[None, :], 0.0)), 0.0)
    if NB >= 2:
        A10 = be1[:, None] * kk10 * tl.exp(G1[:, None] - G0[None, :])
        A11 = tl.where(strict, be1[:, None] * kk11 * tl.exp(tl.where(strict, G1[:, None] - G1[None, :], 0.0)), 0.0)
    if NB >= 4:
        A20 = be2[:, None] * kk20 * tl.exp(G2[:, None] - G0[None, :])
        A21 = be2[:, None] * kk21 * tl.exp(G2[:, None] - G1[None, :])
        A22 = tl.where(strict, be2[:, None] * kk22 * tl.exp(tl.where(strict, G2[:, None] - G2[None, :], 0.0)), 0.0)
        A30 = be3[:, None] * kk30 * tl.exp(G3[:, None] - G0[None, :])
        A31 = be3[:, None] * kk31 * tl.exp(G3[:, None] - G1[None, :])
        A32 = be3[:, None] * kk32 * tl.exp(G3[:, None] - G2[None, :])
        A33 = tl.where(strict, be3[:, None] * kk33 * tl.exp(tl.where(strict, G3[:, None] - G3[None, :], 0.0)), 0.0)
    # (c) diagonal blocks: row i of (I + A_aa)^-1 = e_i - sum_j A_aa[i, j] row j (rows j < i are
    # final; rows >= i are still e_j, which A_aa[i, j] = 0 multiplies), all blocks in one loop
    T00 = eye
    if NB >= 2:
        T11 = eye
    if NB >= 4:
        T22 = eye
        T33 = eye
    for i in range(1, 16):
        sel = i2 == i
        e_i = tl.where(t == i, 1.0, 0.0)
        a0 = tl.sum(tl.where(sel, A00, 0.0), axis=0)    # row i of A00
        T00 = tl.where(sel, (e_i - tl.sum(a0[:, None] * T00, axis=0))[None, :], T00)
        if NB >= 2:
            a1 = tl.sum(tl.where(sel, A11, 0.0), axis=0)
            T11 = tl.where(sel, (e_i - tl.sum(a1[:, None] * T11, axis=0))[None, :], T11)
        if NB >= 4:
            a2 = tl.sum(tl.where(sel, A22, 0.0), axis=0)
            a3 = tl.sum(tl.where(sel, A33, 0.0), axis=0)
            T22 = tl.where(sel, (e_i - tl.sum(a2[:, None] * T22, axis=0))[None, :], T22)
            T33 = tl.where(sel, (e_i - tl.sum(a3[:, None] * T33, axis=0))[None, :], T33)
    # below the diagonal: T_ab = -T_aa (sum_{c=b}^{a-1} A_ac T_cb), fp32 operands
    if NB >= 2:
        T10 = -tl.dot(T11, tl.dot(A10, T00, input_precision=INV_PREC), input_precision=INV_PREC)
    if NB >= 4:
        T21 = -tl.dot(T22, tl.dot(A21, T11, input_precision=INV_PREC), input_precision=INV_PREC)
        T20 = -tl.dot(T22, tl.dot(A21, T10, tl.dot(A20, T00, input_precision=INV_PREC), input_precision=INV_PREC),
                      input_precision=INV_PREC)
        T32 = -tl.dot(T33, tl.dot(A32, T22, input_precision=INV_PREC), input_precision=INV_PREC)
        T31 = -tl.dot(T33, tl.dot(A32, T21, tl.dot(A31, T11, input_precision=INV_PREC), input_precision=INV_PREC),
                      input_precision=INV_PREC)
        X30 = tl.dot(A31, T10, tl.dot(A30, T00, input_precision=INV_PREC), input_precision=INV_PREC)
        T30 = -tl.dot(T33, tl.dot(A32, T20, X30, input_precision=INV_PREC), input_precision=INV_PREC)
    tp = t_ptr + (p.to(tl.int64) * H + h) * (C * C) + i2 * C + j2
    td = t_ptr.dtype.element_ty
    zero = tl.zeros((16, 16), dtype=td)
    tl.store(tp, T00.to(td))
    if NB >= 2:
        tl.store(tp + 16, zero)
        tl.store(tp + 16 * C, T10.to(td))
        tl.store(tp + 16 * C + 16, T11.to(td))
    if NB >= 4:
        tl.store(tp + 32, zero)
        tl.store(tp + 48, zero)
        tl.store(tp + 16 * C + 32, zero)
        tl.store(tp + 16 * C + 48, zero)
        tl.store(tp + 32 * C, T20.to(td))
        tl.store(tp + 32 * C + 16, T21.to(td))
        tl.store(tp + 32 * C + 32, T22.to(td))
        tl.store(tp + 32 * C + 48, zero)
        tl.store(tp + 48 * C, T30.to(td))
        tl.store(tp + 48 * C + 16, T31.to(td))
        tl.store(tp + 48 * C + 32, T32.to(td))
        tl.store(tp + 48 * C + 48, T33.to(td))


@jit
def _wy_wu_kernel(
    k_ptr, v_ptr, b_ptr, row0_ptr, nrow_ptr, gc_ptr, t_ptr, w_ptr, u_ptr, kc_ptr,
    H, REP, DK, DV, s_kt, s_kh, s_vt, s_vh, s_bt, s_ct, s_ch,
    C: tl.constexpr, BK: tl.constexpr, NKB: tl.constexpr,
    OP_DT: tl.constexpr, DOT_DT: tl.constexpr, PREC: tl.constexpr, STORE_KC: tl.constexpr,
):
    # One program per (column block j, value head h, chunk p): j < NKB: columns j*BK.. of
    # W = T (k * beta e^G); else columns (j - NKB)*BK.. of U = T (v * beta). STORE_KC: the first
    # value head of each key head also writes k in the operand dtype to kc [T, Hk, Dk], which the
    # state and output kernels read instead of k: a tile that feeds a dot as it is loaded goes
    # straight to shared memory, one that must be converted first is staged in registers.
    j = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2)
    n = tl.load(nrow_ptr + p)
    if n == 0:
        return   # an empty chunk (as in the inverse kernel)
    r0 = tl.load(row0_ptr + p).to(tl.int64)
    pc = p.to(tl.int64) * H + h
    t = tl.arange(0, C)
    ok = t < n
    Tm = tl.load(t_ptr + pc * (C * C) + t[:, None] * C + t[None, :]).to(OP_DT).to(DOT_DT)
    beta = tl.load(b_ptr + r0 * s_bt + h + t * s_bt, mask=ok, other=0.0).to(tl.float32)
    if j < NKB:
        dc = j * BK + tl.arange(0, BK)
        dm = dc[None, :] < DK
        G = tl.load(gc_ptr + r0 * H + h + t * H, mask=ok, other=0.0)
        kb = k_ptr + r0 * s_kt + (h // REP) * s_kh
        kraw = tl.load(kb + t[:, None] * s_kt + dc[None, :], mask=ok[:, None] & dm, other=0.0)
        if STORE_KC:
            kcb = kc_ptr + r0 * s_ct + (h // REP) * s_ch
            tl.store(kcb + t[:, None] * s_ct + dc[None, :], kraw.to(kc_ptr.dtype.element_ty),
                     mask=ok[:, None] & dm & (h % REP == 0))
        x = kraw.to(tl.float32) * (beta * tl.exp(G))[:, None]
        w = tl.dot(Tm, x.to(OP_DT).to(DOT_DT), input_precision=PREC)
        tl.store(w_ptr + pc * (C * DK) + t[:, None] * DK + dc[None, :], w.to(w_ptr.dtype.element_ty), mask=dm)
    else:
        ec = (j - NKB) * BK + tl.arange(0, BK)
        em = ec[None, :] < DV
        y = tl.load(v_ptr + r0 * s_vt + h * s_vh + t[:, None] * s_vt + ec[None, :], mask=ok[:, None] & em,
                    other=0.0).to(tl.float32) * beta[:, None]
        u = tl.dot(Tm, y.to(OP_DT).to(DOT_DT), input_precision=PREC)
        tl.store(u_ptr + pc * (C * DV) + t[:, None] * DV + ec[None, :], u.to(u_ptr.dtype.element_ty), mask=em)


@jit
def _wy_state_kernel(
    k_ptr, gc_ptr, w_ptr, u_ptr, init_ptr, st_ptr, vn_ptr, fin_ptr,
    row0_ptr, nrow_ptr, chunk0_ptr, nchunk_ptr, init_idx_ptr, fin_idx_ptr,
    H, REP, DK, DV, s_kt, s_kh,
    C: tl.constexpr, DKP: tl.constexpr, BV: tl.constexpr,
    OP_DT: tl.constexpr, DOT_DT: tl.constexpr, PREC: tl.constexpr,
    STORE_ST: tl.constexpr = True, STORE_VN: tl.constexpr = True,
    fin2_ptr=None, fin2_idx_ptr=None, HAS_FIN2: tl.constexpr = False,
):
    # One program per (piece p, value head h, Dv tile). S = init[init_idx] (zeros if < 0), fp32;
    # for each chunk q of the piece: st[q] = S, Vn = U - W S (stored), S = e^Gl S + k^T (Vn e^(Gl-G)).
    # fin[fin_idx] = S at the end when the piece has a chunk and fin_idx >= 0 (and fin2[fin2_idx]
    # with HAS_FIN2: CPR's decode resync sets a slot's boundary and running state at once). init
    # and fin may be the same tensor: each program reads and writes only its own tile. STORE_ST /
    # STORE_VN off: the entering states / Vn are not stored (CPR needs neither in its resync, nor
    # Vn in its trainer); the arithmetic is the same either way.
    p = tl.program_id(0)
    h = tl.program_id(1)
    vt = tl.program_id(2)
    n = tl.load(nchunk_ptr + p)
    if n == 0:
        # nothing to store (fin needs a chunk): return before loading the state tile, which is
        # what a decode resync's lanes without a complete chunk would otherwise spend their time on
        return
    c0 = tl.load(chunk0_ptr + p)
    ii = tl.load(init_idx_ptr + p).to(tl.int64)
    kh = h // REP
    dk = tl.arange(0, DKP)
    dv = vt * BV + tl.arange(0, BV)
    t = tl.arange(0, C)
    km = dk < DK
    vm = dv < DV
    sm = km[:, None] & vm[None, :]
    soff = dk[:, None] * DV + dv[None, :]
    hs = DK * DV
    S = tl.load(init_ptr + (tl.maximum(ii, 0) * H + h) * hs + soff, mask=sm & (ii >= 0), other=0.0)
    for c in range(0, n):
        q = c0 + c
        r0 = tl.load(row0_ptr + q).to(tl.int64)
        nr = tl.load(nrow_ptr + q)
        ok = t < nr
        pc = q.to(tl.int64) * H + h
        if STORE_ST:
            tl.store(st_ptr + pc * hs + soff, S.to(st_ptr.dtype.element_ty), mask=sm)
        W = tl.load(w_ptr + pc * (C * DK) + t[:, None] * DK + dk[None, :], mask=km[None, :], other=0.0)
        vrow = pc * (C * DV) + t[:, None] * DV + dv[None, :]
        U = tl.load(u_ptr + vrow, mask=vm[None, :], other=0.0)
        Vn = U.to(tl.float32) - tl.dot(W.to(OP_DT).to(DOT_DT), S.to(OP_DT).to(DOT_DT), input_precision=PREC)
        if STORE_VN:
            tl.store(vn_ptr + vrow, Vn.to(vn_ptr.dtype.element_ty), mask=vm[None, :])
        cb = gc_ptr + r0 * H + h
        Gc = tl.load(cb + t * H, mask=ok, other=0.0)
        gl = tl.load(cb + (nr - 1) * H)
        Vd = Vn * tl.where(ok, tl.exp(gl - Gc), 0.0)[:, None]
        Kt = tl.load(k_ptr + r0 * s_kt + kh * s_kh + t[None, :] * s_kt + dk[:, None], mask=km[:, None] & ok[None, :],
                     other=0.0)
        S = tl.dot(Kt.to(OP_DT).to(DOT_DT), Vd.to(OP_DT).to(DOT_DT), S * tl.exp(gl), input_precision=PREC)
    fi = tl.load(fin_idx_ptr + p).to(tl.int64)
    tl.store(fin_ptr + (tl.maximum(fi, 0) * H + h) * hs + soff, S, mask=sm & (fi >= 0))
    if HAS_FIN2:
        f2 = tl.load(fin2_idx_ptr + p).to(tl.int64)
        tl.store(fin2_ptr + (tl.maximum(f2, 0) * H + h) * hs + soff, S, mask=sm & (f2 >= 0))


@jit
def _wy_out_kernel(
    q_ptr, k_ptr, gc_ptr, st_ptr, vn_ptr, o_ptr, row0_ptr, nrow_ptr,
    H, REP, DK, DV, s_qt, s_qh, s_kt, s_kh, s_ot, s_oh,
    C: tl.constexpr, DKP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    OP_DT: tl.constexpr, DOT_DT: tl.constexpr, PREC: tl.constexpr,
):
    # One program per (Dv tile, value head h, chunk p): o = e^G (q S) + (causal(q k^T) decay) Vn.
    vt = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2)
    n = tl.load(nrow_ptr + p)
    r0 = tl.load(row0_ptr + p).to(tl.int64)
    pc = p.to(tl.int64) * H + h
    kh = h // REP
    qb = q_ptr + r0 * s_qt + kh * s_qh
    kb = k_ptr + r0 * s_kt + kh * s_kh
    sb = st_ptr + pc * (DK * DV)
    t = tl.arange(0, C)
    ok = t < n
    dv = vt * BV + tl.arange(0, BV)
    vm = dv[None, :] < DV
    qk = tl.zeros((C, C), dtype=tl.float32)
    o = tl.zeros((C, BV), dtype=tl.float32)
    for d0 in range(0, DKP, BK):
        dc = d0 + tl.arange(0, BK)
        dm = dc[None, :] < DK
        Q = tl.load(qb + t[:, None] * s_qt + dc[None, :], mask=ok[:, None] & dm, other=0.0).to(OP_DT).to(DOT_DT)
        K = tl.load(kb + t[:, None] * s_kt + dc[None, :], mask=ok[:, None] & dm, other=0.0).to(OP_DT).to(DOT_DT)
        Sb = tl.load(sb + dc[:, None] * DV + dv[None, :], mask=(dc[:, None] < DK) & vm, other=0.0).to(OP_DT).to(DOT_DT)
        qk = tl.dot(Q, tl.trans(K), qk, input_precision=PREC)
        o = tl.dot(Q, Sb, o, input_precision=PREC)
    G = tl.load(gc_ptr + r0 * H + h + t * H, mask=ok, other=0.0)
    i2 = t[:, None]
    j2 = t[None, :]
    # padding rows (G read as 0) are left out of the exponent too: G_i - G_j > 0 there
    incl = (j2 <= i2) & ok[:, None]
    M = tl.where(incl, qk * tl.exp(tl.where(incl, G[:, None] - G[None, :], 0.0)), 0.0)
    Vn = tl.load(vn_ptr + pc * (C * DV) + i2 * DV + dv[None, :], mask=vm, other=0.0).to(OP_DT).to(DOT_DT)
    o = o * tl.exp(G)[:, None]
    o = tl.dot(M.to(OP_DT).to(DOT_DT), Vn, o, input_precision=PREC)
    tl.store(o_ptr + r0 * s_ot + h * s_oh + t[:, None] * s_ot + dv[None, :], o, mask=ok[:, None] & vm)


# --------------------------------------------------------------------------- launcher


def _rows3(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def wy_chunk_triton(q, k, v, g, beta, starts, lens, init, fin, fin_idx, chunk: int = CHUNK,
                    choice: NativeWYChoice | None = None, t_out: torch.Tensor | None = None,
                    states_dtype: torch.dtype | None = None):
    """The native WY chunk forward over B pieces (rows ``starts[b] .. starts[b] + lens[b]``), chunks
    cut from each piece's first token. ``init`` [B, H, Dk, Dv] fp32: piece b starts from
    ``init[b]`` (None: from zero); the final state of piece b goes to ``fin[fin_idx[b]]``
    (``fin_idx[b] < 0`` or an empty piece: not written; ``fin`` may be None). ``t_out``: the
    chunks' T = (I + A)^-1 [P, H, C, C] are stored there (tests). Returns o [T, H, Dv] fp32.
    CUDA tensors, or CPU tensors under the interpreter."""
    f = wy_forward_parts(q, k, v, g, beta, starts, lens, init, fin, fin_idx, chunk, choice, states_dtype)
    o = torch.empty(k.shape[0], v.shape[1], v.shape[2], dtype=torch.float32, device=v.device)
    if f is None:
        return o
    if t_out is not None:
        t_out.copy_(f.T)
    launch_wy_out(q, f, o, chunk)
    return o


def launch_wy_out(q, f: "WYParts", o: torch.Tensor, C: int) -> None:
    """The output kernel over the chunks of ``f`` (what ``wy_forward_parts`` or a caller's own
    launches of the first three kernels left): o's rows of every chunk, written in place."""
    dm = f.dims
    q = _rows3(q)
    obv = min(f.choice.out_bv, dm["DVP"])
    _wy_out_kernel[(-(-dm["Dv"] // obv), dm["H"], f.P)](
        q, f.kc, f.gc, f.states, f.vn, o, f.row0, f.nrow, dm["H"], dm["rep"], dm["Dk"], dm["Dv"],
        q.stride(0), q.stride(1), f.kc.stride(0), f.kc.stride(1), o.stride(0), o.stride(1),
        C=C, DKP=dm["DKP"], BK=dm["BK"], BV=obv, **f.num,
        num_warps=f.choice.out_warps, num_stages=f.choice.out_stages)


@dataclass
class WYParts:
    """What the forward's first three kernels leave (``wy_forward_parts``): plan index tensors
    (row0, nrow per chunk; chunk0, nchunk per piece), G [T, H] fp32, T [P, H, C, C], W
    [P, H, C, Dk], k in the operand dtype ``kc`` [T, Hk, Dk] (k itself in the fp32 modes), the
    states entering each chunk [P, H, Dk, Dv] and Vn [P, H, C, Dv]; ``num`` the kernels' numeric
    constexprs, ``dims`` the sizes and tiles, ``st_dt`` the storage dtype."""

    choice: NativeWYChoice
    P: int
    B: int
    row0: torch.Tensor
    nrow: torch.Tensor
    chunk0: torch.Tensor
    nchunk: torch.Tensor
    gc: torch.Tensor
    T: torch.Tensor
    W: torch.Tensor
    kc: torch.Tensor
    states: torch.Tensor
    vn: torch.Tensor
    num: dict
    dims: dict
    st_dt: torch.dtype


def launch_inverse_wu(k, v, g, beta, row0, nrow, kc, n_rows, H, rep, C, BK, num, st_dt, inv_dot, inv_warps,
                      wu_warps, t_dtype=None):
    """The inverse and W/U kernels over the chunks of ``row0`` / ``nrow`` (int32 on device; a chunk
    of 0 rows is skipped by its programs): returns (G [n_rows, H] fp32, T [P, H, C, C], W [P, H, C,
    Dk], U [P, H, C, Dv]) in ``st_dt`` (T in ``t_dtype`` if given: its readers round it to the
    operand dtype as they load it, so fp32 storage changes no bit). ``kc``: where the W/U kernel
    writes k in the operand dtype (``k`` itself: nothing written)."""
    Dk, Dv = k.shape[-1], v.shape[-1]
    P = row0.shape[0]
    dev = v.device
    DKP = max(16, next_pow2(Dk))
    gc = torch.empty(n_rows, H, dtype=torch.float32, device=dev)
    Tm = torch.empty(P, H, C, C, dtype=t_dtype or st_dt, device=dev)
    W = torch.empty(P, H, C, Dk, dtype=st_dt, device=dev)
    U = torch.empty(P, H, C, Dv, dtype=st_dt, device=dev)
    _wy_inverse_kernel[(H, P)](
        k, g, beta, row0, nrow, gc, Tm, H, rep, Dk, k.stride(0), k.stride(1), g.stride(0), beta.stride(0),
        C=C, NB=C // 16, DKP=DKP, BK=BK, INV_PREC=inv_dot, **num, num_warps=inv_warps)
    nkb = -(-Dk // BK)
    _wy_wu_kernel[(nkb + -(-Dv // BK), H, P)](
        k, v, beta, row0, nrow, gc, Tm, W, U, kc, H, rep, Dk, Dv,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), beta.stride(0), kc.stride(0), kc.stride(1),
        C=C, BK=BK, NKB=nkb, STORE_KC=kc is not k, **num, num_warps=wu_warps)
    return gc, Tm, W, U


def launch_wy_state(kc, gc, W, U, init, st, vn, fin, row0, nrow, chunk0, nchunk, init_idx, fin_idx, H, rep, C,
                    DKP, BV, num, warps, stages, fin2=None, fin2_idx=None):
    """The state kernel over the pieces or lanes of ``chunk0`` / ``nchunk`` (see
    ``_wy_state_kernel``); ``st`` / ``vn`` None: the entering states / Vn are not stored;
    ``fin2``: a second final state (``fin2_idx``)."""
    Dk, Dv = W.shape[-1], U.shape[-1]
    _wy_state_kernel[(chunk0.shape[0], H, -(-Dv // BV))](
        kc, gc, W, U, init, U if st is None else st, U if vn is None else vn, fin, row0, nrow, chunk0, nchunk,
        init_idx, fin_idx, H, rep, Dk, Dv, kc.stride(0), kc.stride(1), C=C, DKP=DKP, BV=BV, **num,
        STORE_ST=st is not None, STORE_VN=vn is not None, fin2_ptr=fin2, fin2_idx_ptr=fin2_idx,
        HAS_FIN2=fin2 is not None, num_warps=warps, num_stages=stages)


def wy_forward_parts(q, k, v, g, beta, starts, lens, init, fin, fin_idx, chunk: int = CHUNK,
                     choice: NativeWYChoice | None = None, states_dtype: torch.dtype | None = None,
                     vn_dtype: torch.dtype | None = None, t_dtype: torch.dtype | None = None,
                     init_idx: list[int] | None = None, fin2=None, fin2_idx: list[int] | None = None) -> WYParts | None:
    """The inverse, W/U and state kernels of the forward (arguments as ``wy_chunk_triton``); None
    when there is no chunk. The backward recomputes the forward with this. ``states_dtype``: the
    storage of the states entering each chunk (default: the choice's storage dtype); fp32 keeps
    them exact (CPR's chunk-form engine reads the open chunk's from there) and gives the output
    kernel the same operand bits, which it rounds to the operand dtype as it loads them. ``vn_dtype``:
    likewise for Vn (fp32: CPR's engine keeps the open chunk's unrounded Vn for its decode), and
    ``t_dtype`` for T (fp32: CPR's engine keeps the open chunk's rows of T for its decode).
    ``init_idx``: piece b starts from ``init[init_idx[b]]`` (-1: from zero) instead of ``init[b]``, so
    that an engine passes its slots' states as they are, with no gathered copy; ``fin2`` /
    ``fin2_idx``: a second destination of the final states (in ``fin2``'s dtype, the store's
    conversion)."""
    choice = choice or NATIVE_WY
    if chunk not in WY_CHUNKS:
        raise ValueError(f"the WY kernels take chunks of {WY_CHUNKS} tokens; got {chunk}")
    T, Hk, Dk = k.shape
    H, Dv = v.shape[1], v.shape[2]
    rep = H // Hk
    dev = v.device
    C = chunk
    B = len(lens)
    dot = _resolve_dot(choice, v.dtype)
    OP_DT, DOT_DT, PREC, st_dt = _dtypes(dot)
    num = dict(OP_DT=OP_DT, DOT_DT=DOT_DT, PREC=PREC)
    k, v = _rows3(k), _rows3(v)
    g, beta = g.contiguous(), beta.contiguous()
    row0, nrow, _sidx, chunk0, nchunk, _s0, _ns = chunk_plan(starts, lens, C)
    P = len(row0)
    if P == 0:
        return None
    DKP, DVP = max(16, next_pow2(Dk)), max(16, next_pow2(Dv))
    BK = min(choice.bk, DKP, DVP)
    dims = dict(T=T, Hk=Hk, H=H, Dk=Dk, Dv=Dv, rep=rep, DKP=DKP, DVP=DVP, BK=BK)
    if init is None:
        init_idx = [-1] * B
    elif init_idx is None:
        init_idx = list(range(B))
    if fin is None:
        fin_idx = [-1] * B
    extra = [list(fin2_idx)] if fin2 is not None else []
    # every index list in one host-to-device copy (the host has just synchronised on cu_seqlens,
    # so each separate copy would leave the GPU idle a little longer)
    row0_t, nrow_t, chunk0_t, nchunk_t, init_t, fin_t, *fin2_t = int32_segments(
        [row0, nrow, chunk0, nchunk, init_idx, fin_idx] + extra, dev)
    # k in the operand dtype for the state and output kernels: a copy when that is not k's dtype
    kc = k if k.dtype == st_dt else torch.empty(T, Hk, Dk, dtype=st_dt, device=dev)
    gc, Tm, W, U = launch_inverse_wu(k, v, g, beta, row0_t, nrow_t, kc, T, H, rep, C, BK, num, st_dt,
                                      choice.inv_dot, choice.prep_warps, choice.wu_warps, t_dtype)
    states = torch.empty(P, H, Dk, Dv, dtype=states_dtype or st_dt, device=dev)
    vn = torch.empty(P, H, C, Dv, dtype=vn_dtype or st_dt, device=dev)
    # a missing init / fin is never dereferenced (index -1 masks the access): gc stands in
    launch_wy_state(kc, gc, W, U, init if init is not None else gc, states, vn, fin if fin is not None else gc,
                    row0_t, nrow_t, chunk0_t, nchunk_t, init_t, fin_t, H, rep, C, DKP,
                    state_tile(choice, st_dt, DVP), num, choice.state_warps, choice.state_stages,
                    fin2=fin2, fin2_idx=fin2_t[0] if fin2_t else None)
    return WYParts(choice, P, B, row0_t, nrow_t, chunk0_t, nchunk_t, gc, Tm, W, kc, states, vn, num, dims, st_dt)


# --------------------------------------------------------------------------- torch twin


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """A value rounded to bf16 (nearest even, as a GPU converts) and back to x's dtype: the twin's
    operand rounding in "bf16" mode. (The Triton interpreter truncates instead; its tests swap
    this function for a truncating one to compare like with like.)"""
    return x.to(torch.bfloat16).to(x.dtype)


def blocked_unit_lower_inverse(A: torch.Tensor, block: int = 16) -> torch.Tensor:
    """(I + A)^-1 for strictly lower triangular A [..., C, C] (C a multiple of ``block``), as the
    prep kernel computes it: each diagonal block by forward substitution row by row, the blocks
    below it by T_ab = -T_aa sum_{c=b}^{a-1} A_ac T_cb. Stock torch ops, A's dtype."""
    C = A.shape[-1]
    nb = C // block
    if nb * block != C:
        raise ValueError(f"chunk {C} is not a multiple of the block {block}")
    T = torch.zeros_like(A)
    eye = torch.eye(block, dtype=A.dtype, device=A.device)
    blk = lambda x, a, b: x[..., a * block:(a + 1) * block, b * block:(b + 1) * block]  # noqa: E731
    for a in range(nb):
        Aa = blk(A, a, a)
        Ta = eye.expand_as(Aa).clone()
        for i in range(1, block):
            Ta[..., i, :] = eye[i] - (Aa[..., i, :, None] * Ta).sum(-2)
        blk(T, a, a).copy_(Ta)
        for b in range(a - 1, -1, -1):
            acc = sum(blk(A, a, c) @ blk(T, c, b) for c in range(b, a))
            blk(T, a, b).copy_(-(Ta @ acc))
    return T


def wy_chunk_torch(q, k, v, g, beta, cu_seqlens, *, chunk: int = CHUNK, initial_state=None,
                   output_final_state: bool = False, dot: str = "tf32"):
    """Torch twin of :func:`wy_chunk_triton` (sequences of ``cu_seqlens``, chunks from each
    sequence's first token): the same decomposition with the same rounding points; ``dot`` "bf16"
    rounds every large dot's operands to bf16 and stores W, U, the entering states and Vn in bf16
    (fp32 accumulation), anything else computes in fp32 (float64 for float64 inputs). Returns o
    [T, H, Dv] (and the final states [B, H, Dk, Dv] if asked)."""
    starts, lens, T, dt, qp, kp, vp, gp, bp = _prepare(q, k, v, g, beta, cu_seqlens, chunk)
    B, H, W_, Dk = kp.shape
    Dv = vp.shape[-1]
    C = chunk
    nc = W_ // C
    r = round_bf16 if dot == "bf16" else (lambda x: x)
    qc, kc, vc = (x.reshape(B, H, nc, C, -1) for x in (qp, kp, vp))
    gc, bc = gp.reshape(B, H, nc, C), bp.reshape(B, H, nc, C)
    G = gc.cumsum(-1)
    idx = torch.arange(C, device=v.device)
    incl = idx[None, :] <= idx[:, None]
    strict = idx[None, :] < idx[:, None]
    dG = G[..., :, None] - G[..., None, :]
    zero = torch.zeros((), dtype=dt, device=v.device)
    A = torch.where(strict, bc[..., :, None] * (r(kc) @ r(kc).transpose(-1, -2))
                    * torch.where(strict, dG, zero).exp(), zero)
    Tm = blocked_unit_lower_inverse(A)
    Wk = r(r(Tm) @ r(kc * (bc * G.exp())[..., None]))
    U = r(r(Tm) @ r(vc * bc[..., None]))
    M = torch.where(incl, (r(qc) @ r(kc).transpose(-1, -2)) * torch.where(incl, dG, zero).exp(), zero)
    # the last valid row's G of a partial chunk is G at row C - 1 (padding has g = 0)
    g_last = G[..., -1]
    S = initial_state.to(dt) if initial_state is not None else torch.zeros(B, H, Dk, Dv, dtype=dt, device=v.device)
    outs = []
    for c in range(nc):
        Sr = r(S)
        vn = U[:, :, c] - r(Wk[:, :, c]) @ Sr
        vnr = r(vn)
        outs.append((r(qc[:, :, c]) @ Sr) * G[:, :, c, :, None].exp() + r(M[:, :, c]) @ vnr)
        vd = vn * (g_last[:, :, c, None] - G[:, :, c]).exp()[..., None]
        S = S * g_last[:, :, c, None, None].exp() + r(kc[:, :, c]).transpose(-1, -2) @ r(vd)
    o = torch.stack(outs, dim=2).reshape(B, H, W_, Dv).transpose(1, 2)
    o = _unpad_seqs(o, starts, lens, T)
    return (o, S) if output_final_state else o
