"""CPR's boundary states by the WY kernels (``CPRKernelChoice.boundary = "wy"``).

CPR needs one function ``chunk_update(B_c, chunk c's C tokens) -> B_c+1`` that every case (trainer,
engine prefill split anywhere, decode resync) evaluates with the same arithmetic. The "rows" form
(``triton_kernels._gdn_prep_kernel`` + ``_gdn_state_kernel``) inverts I + A row by row over a
64 x 64 register tile and carries the decay on the k side. This module evaluates the update with
the native chunk path's kernels (``native_wy.py``: the 16 x 16 blocked inverse, W/U as full C-row
dots, the state pass with the decay on the Vn side) at fp32 operands and fp32 storage, with the
dot precision of the choice (``"tf32x3"``: three TF32 tensor-core products, about fp32 accuracy)
and its ``wy_bk`` (Dk / Dv block of the inverse's and W/U's dots) and ``wy_warps``:

    G = cumsum(g) per 16-row block plus the blocks before it;  A_ij = beta_i (k_i . k_j) e^(G_i - G_j)
    T = (I + A)^-1 (diagonal 16 x 16 blocks by forward substitution, the blocks below by 16 x 16
        fp32 FMA dots);  W = T (k beta e^G);  U = T (v beta)
    Vn = U - W B_c;  B_c+1 = e^Gl B_c + k^T (Vn e^(Gl - G))

Every kernel program computes one chunk (inverse, W/U) or one (sequence or lane, head, Dv tile)
chain (state) from its own inputs only, so the bits of a chunk's update do not depend on the batch,
on how many chunks the chain runs before it (the state is fp32 in registers and fp32 when stored:
a chain resumed from a stored boundary continues with the same values) or on the case. Decode's
resync launches the same three kernels over every lane with a row count of 0 for the lanes whose
chunk did not complete: their programs return at once (no host sync, CUDA-graph capturable).

This is a different ``chunk_update`` from the "rows" form (other bits, same function at fp32
accuracy); a choice with ``boundary = "wy"`` is a different ``gdn_cpr`` version.
"""

from __future__ import annotations

import torch

from .native_wy import FP32_STATE_BV, WY_CHUNKS, _dtypes, launch_inverse_wu, launch_wy_state
from .._triton_util import int32_segments, next_pow2


def _parts(k, v, g, beta, row0, nrow, rep, chunk, choice):
    """The inverse and W/U kernels over the chunks of ``row0`` / ``nrow`` at the choice's fp32
    operands: (G, W, U, the kernels' numeric constexprs)."""
    if chunk not in WY_CHUNKS:
        raise ValueError(f"the WY boundary form takes chunks of {WY_CHUNKS} tokens; got {chunk} (the 'rows' "
                         "form, CPRKernelChoice(boundary='rows'), takes any chunk)")
    OP_DT, DOT_DT, PREC, st_dt = _dtypes(choice.dot)
    num = dict(OP_DT=OP_DT, DOT_DT=DOT_DT, PREC=PREC)
    bk = min(choice.wy_bk, max(16, next_pow2(k.shape[-1])), max(16, next_pow2(v.shape[-1])))
    gc, _T, W, U = launch_inverse_wu(k, v, g, beta, row0, nrow, k, k.shape[0], v.shape[1], rep, chunk, bk, num,
                                     st_dt, "ieee", choice.wy_warps, choice.wy_warps)
    return gc, W, U, num


def _state(k, gc, W, U, init, st, fin, row0, nrow, chunk0, nchunk, init_idx, fin_idx, rep, chunk, num, choice,
           fin2=None, fin2_idx=None):
    """The state kernel at fp32 storage (its Dv tile capped at ``FP32_STATE_BV``), one stage, no Vn."""
    Dk, Dv = W.shape[-1], U.shape[-1]
    launch_wy_state(k, gc, W, U, init, st, None, fin, row0, nrow, chunk0, nchunk, init_idx, fin_idx, U.shape[1],
                    rep, chunk, max(16, next_pow2(Dk)), min(FP32_STATE_BV, max(16, next_pow2(Dv))), num,
                    choice.wy_warps, 1, fin2=fin2, fin2_idx=fin2_idx)


def wy_boundary_chain(k, v, g, beta, row0, chunk0, nfull, init, rep, chunk, choice):
    """Pass 1 of the trainer / prefill in the WY form over the P complete chunks starting at rows
    ``row0``; sequence b owns chunks ``chunk0[b] .. chunk0[b] + nfull[b] - 1`` and starts from
    ``init[b]`` (None: zero). Returns states [P + B, H, Dk, Dv] fp32: ``states[chunk0[b] + c]``
    enters complete chunk c of b, ``states[P + b]`` is b's boundary after its complete chunks (its
    start state if it has none)."""
    Dk, H, Dv = k.shape[-1], v.shape[1], v.shape[-1]
    dev = v.device
    B = len(nfull)
    P = len(row0)
    states = torch.empty(P + B, H, Dk, Dv, dtype=torch.float32, device=dev)
    if init is not None:
        states[P:].copy_(init)
    else:
        states[P:].zero_()
    if P == 0:
        return states
    row0_t, nrow_t, chunk0_t, nchunk_t, init_t, fin_t = int32_segments(
        (row0, [chunk] * P, chunk0, nfull, range(B) if init is not None else [-1] * B, range(B)), dev)
    gc, W, U, num = _parts(k, v, g, beta, row0_t, nrow_t, rep, chunk, choice)
    _state(k, gc, W, U, init if init is not None else gc, states[:P], states[P:], row0_t, nrow_t, chunk0_t,
           nchunk_t, init_t, fin_t, rep, chunk, num, choice)
    return states


def wy_resync(state, slots32, full, lanes, chunk, choice):
    """Decode's resync in the WY form: for every lane whose buffered chunk is complete (``full``
    int32 [B], 0 or 1, on device), ``boundary = running = chunk_update(boundary, buffer)`` of its
    slot; the other lanes' programs return at once."""
    bk, bv, bg, bb = state.buffer_rows()
    row0 = slots32 * chunk
    nrow = full * chunk
    gc, W, U, num = _parts(bk, bv, bg, bb, row0, nrow, 1, chunk, choice)
    _state(bk, gc, W, U, state.boundary, None, state.boundary, row0, nrow, lanes, full, slots32, slots32,
           1, chunk, num, choice, fin2=state.running, fin2_idx=slots32)
