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

from .native_wy import WY_CHUNKS, _dtypes, _wy_inverse_kernel, _wy_state_kernel, _wy_wu_kernel
from .._triton_util import next_pow2

WY_STATE_BV = 32
"""Dv tile of the state kernel here (fp32 operands: compiled for sm_90, a 32-wide tile at one
stage takes 32 KB of shared memory and spills less than a 64-wide one)."""


def _dims(Dk: int, Dv: int, bk: int) -> dict:
    DKP, DVP = max(16, next_pow2(Dk)), max(16, next_pow2(Dv))
    return dict(DKP=DKP, DVP=DVP, BK=min(bk, DKP, DVP), BV=min(WY_STATE_BV, DVP))


def _inverse_wu(k, v, g, beta, row0, nrow, H, rep, chunk, choice, n_rows_g):
    """The inverse and W/U kernels over P chunks (row0 / nrow int32 [P] on device): returns
    (gc [n_rows_g, H] fp32, W [P, H, C, Dk], U [P, H, C, Dv]) (fp32 storage)."""
    if chunk not in WY_CHUNKS:
        raise ValueError(f"the WY boundary form takes chunks of {WY_CHUNKS} tokens; got {chunk} (the 'rows' "
                         "form, CPRKernelChoice(boundary='rows'), takes any chunk)")
    Dk, Dv = k.shape[-1], v.shape[-1]
    P = row0.shape[0]
    dev = v.device
    d = _dims(Dk, Dv, choice.wy_bk)
    OP_DT, DOT_DT, PREC, st_dt = _dtypes(choice.dot)
    num = dict(OP_DT=OP_DT, DOT_DT=DOT_DT, PREC=PREC)
    gc = torch.empty(n_rows_g, H, dtype=torch.float32, device=dev)
    Tm = torch.empty(P, H, chunk, chunk, dtype=st_dt, device=dev)
    W = torch.empty(P, H, chunk, Dk, dtype=st_dt, device=dev)
    U = torch.empty(P, H, chunk, Dv, dtype=st_dt, device=dev)
    _wy_inverse_kernel[(H, P)](
        k, g, beta, row0, nrow, gc, Tm, H, rep, Dk, k.stride(0), k.stride(1), g.stride(0), beta.stride(0),
        C=chunk, NB=chunk // 16, DKP=d["DKP"], BK=d["BK"], INV_PREC="ieee", **num, num_warps=choice.wy_warps)
    nkb = -(-Dk // d["BK"])
    _wy_wu_kernel[(nkb + -(-Dv // d["BK"]), H, P)](
        k, v, beta, row0, nrow, gc, Tm, W, U, k, H, rep, Dk, Dv,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), beta.stride(0), k.stride(0), k.stride(1),
        C=chunk, BK=d["BK"], NKB=nkb, STORE_KC=False, **num, num_warps=choice.wy_warps)
    return gc, W, U, num


def _state(k, gc, W, U, init, st, fin, row0, nrow, chunk0, nchunk, init_idx, fin_idx, H, rep, chunk, num, choice,
           fin2=None, fin2_idx=None):
    """The state kernel over len(chunk0) pieces or lanes (see ``_wy_state_kernel``); ``st`` None:
    the entering states are not stored."""
    Dk, Dv = W.shape[-1], U.shape[-1]
    d = _dims(Dk, Dv, choice.wy_bk)
    B = chunk0.shape[0]
    _wy_state_kernel[(B, H, -(-Dv // d["BV"]))](
        k, gc, W, U, init, st if st is not None else U, U, fin, row0, nrow, chunk0, nchunk, init_idx, fin_idx,
        H, rep, Dk, Dv, k.stride(0), k.stride(1), C=chunk, DKP=d["DKP"], BV=d["BV"], **num,
        STORE_ST=st is not None, STORE_VN=False, fin2_ptr=fin2, fin2_idx_ptr=fin2_idx, HAS_FIN2=fin2 is not None,
        num_warps=choice.wy_warps, num_stages=1)


def wy_boundary_chain(k, v, g, beta, starts, nfull, init, rep, chunk, choice):
    """Pass 1 of the trainer / prefill in the WY form. Sequence b has ``nfull[b]`` complete chunks
    from row ``starts[b]``; it starts from ``init[b]`` (None: zero). Returns (states [P + B, H, Dk,
    Dv] fp32, chunk0): ``states[chunk0[b] + c]`` is the state entering complete chunk c of b and
    ``states[P + b]`` b's boundary after its complete chunks (its start state if it has none)."""
    Dk, H, Dv = k.shape[-1], v.shape[1], v.shape[-1]
    dev = v.device
    B = len(nfull)
    row0, chunk0 = [], []
    for s, nf in zip(starts, nfull):
        chunk0.append(len(row0))
        row0 += [s + c * chunk for c in range(nf)]
    P = len(row0)
    states = torch.empty(P + B, H, Dk, Dv, dtype=torch.float32, device=dev)
    if init is not None:
        states[P:].copy_(init)
    else:
        states[P:].zero_()
    if P == 0:
        return states, chunk0
    idx = torch.tensor(row0 + [chunk] * P + chunk0 + list(nfull) + (list(range(B)) if init is not None else [-1] * B)
                       + list(range(B)), dtype=torch.int32).to(dev)
    row0_t, nrow_t, chunk0_t, nchunk_t, init_t, fin_t = torch.split(idx, [P, P, B, B, B, B])
    gc, W, U, num = _inverse_wu(k, v, g, beta, row0_t, nrow_t, H, rep, chunk, choice, k.shape[0])
    _state(k, gc, W, U, init if init is not None else gc, states[:P], states[P:], row0_t, nrow_t, chunk0_t,
           nchunk_t, init_t, fin_t, H, rep, chunk, num, choice)
    return states, chunk0


def wy_resync(state, slots32, full, lanes, chunk, choice):
    """Decode's resync in the WY form: for every lane whose buffered chunk is complete (``full``
    int32 [B], 0 or 1, on device), ``boundary = running = chunk_update(boundary, buffer)`` of its
    slot; the other lanes' programs return at once."""
    H, Dk, Dv = state.boundary.shape[1], state.boundary.shape[2], state.boundary.shape[3]
    bk = state.buf_k.view(-1, H, Dk)
    bv = state.buf_v.view(-1, H, Dv)
    bg = state.buf_g.view(-1, H)
    bb = state.buf_beta.view(-1, H)
    row0 = slots32 * chunk
    nrow = full * chunk
    gc, W, U, num = _inverse_wu(bk, bv, bg, bb, row0, nrow, H, 1, chunk, choice, bk.shape[0])
    _state(bk, gc, W, U, state.boundary, None, state.boundary, row0, nrow, lanes, full, slots32, slots32,
           H, 1, chunk, num, choice, fin2=state.running, fin2_idx=slots32)
