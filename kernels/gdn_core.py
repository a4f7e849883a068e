"""Gated DeltaNet core by CPR (chunkwise-parallel recurrent): one rounding schedule for the
trainer, engine prefill (split anywhere) and engine decode.

Public API
  ``CHUNK``                                  chunk size C (64), pinned in the contract
  ``GDNState``                               per-layer recurrent state of S engine slots
  ``gdn_cpr_varlen(q, k, v, g, beta, cu_seqlens, *, chunk)``               trainer (autograd)
  ``gdn_cpr_engine(q, k, v, g, beta, cu_seqlens_q, slots, state, *, chunk)`` engine prefill
  ``gdn_cpr_decode(q, k, v, g, beta, slots, state, *, chunk)``             engine decode
  ``*_reference`` / ``*_triton`` twins of the three; CUDA tensors go to Triton, others to the
  reference (``want_triton``).

The function (one value head h, key head ``h // (H // Hk)``, fp32 state S [Dk, Dv] starting at
zero; q and k are L2-normalised by the caller and q is already scaled by Dk^-0.5)::

    S = S * exp(g_t);  kv = S^T k_t;  delta = (v_t - kv) * beta_t;  S = S + k_t delta^T;
    o_t = S^T q_t

Shapes: q, k [T, Hk, Dk] fp32; v [T, H, Dv] bf16/fp32; g (log decay <= 0), beta [T, H] fp32;
o [T, H, Dv] fp32. (float64 inputs run the reference in float64: used by gradcheck only.)

CPR schedule (the same for every case)
--------------------------------------
Positions are absolute within a sequence. Chunk c holds positions [cC, cC + C).

* Boundary states: B_0 = 0 and B_{c+1} = chunk_update(B_c, the C tokens of chunk c), only for
  complete chunks. ``chunk_update`` (WY/UT form, fp32, fixed order)::

      G_t   = (((+0 + g_0) + g_1) + ... + g_t)              running sum in token order
      A_ij  = ((k_i . k_j) * beta_i) * exp(G_i - G_j)        j < i, else 0
      T     = (I + A)^-1                                     forward substitution, row i:
              T_i = e_i - sum_j A_ij T_j                      (rows in order 1..C-1)
      W     = T @ (k * (beta * exp(G)))     U = T @ (v * beta)
      Vnew  = U - W @ B_c
      B_c+1 = B_c * exp(G_{C-1}) + (k * exp(G_{C-1} - G))^T @ Vnew

* Token outputs: token t of chunk c runs the per-token step above from B_c through the tokens
  of chunk c up to t; o_t is read from the state after the step. The state after the last
  token of a complete chunk is dropped (the next chunk starts from B_{c+1}).

* Cases. trainer / prefill: pass 1 = the B_c chain (sequential over chunks, parallel over
  sequences and heads), pass 2 = every chunk's in-chunk recurrence in parallel. Engine prefill
  of a piece continues from the slot's state: the tokens of the open chunk buffered in the state
  are prepended to the piece (their outputs are dropped), so the piece is processed as a
  sequence that starts on a boundary, from B_c. Decode: one step from ``running``; the token is
  appended to the buffer; when the chunk completes, ``boundary = chunk_update(boundary, buffer)``
  and ``running = boundary``.
  Since chunk_update always sees the same C tokens from the same boundary, and the per-token
  step always starts from the same boundary (the buffered prefix reproduces ``running`` exactly),
  every case gives the same bits, provided the two functions are the same code with the same
  reduction order in every case. They are: one reference function each, one Triton kernel each.

Reference twin (impl ``ref_gdn_cpr``): built from IEEE basic ops only: exp by
:func:`isoexec_kernels._ref.exp64` rounded once; every dot product (over Dk, or over the C
tokens of a chunk) by the halves tree of :func:`isoexec_kernels._ref.tree_sum0`; the forward
substitution's sum over j runs over all C rows (zero terms for j >= i) by the same tree. Batch
rows never mix, so results do not depend on batch composition, padding or case.

Triton twin (impl ``triton_gdn_cpr``): three kernels, each used by every case.
  ``_gdn_prep_kernel`` (per complete chunk and head: G by ``tl.cumsum``, k.k^T by ``tl.dot``
  over Dk blocks of ``BLOCK_DK`` accumulated in order, T by forward substitution in registers
  (masked ``tl.sum`` over the C rows), W/U by ``tl.dot``); ``_gdn_state_kernel`` (the B_c chain,
  one program per (sequence or lane, head, Dv tile of ``BLOCK_DV``); Vnew and B_c+1 by
  ``tl.dot``); ``_gdn_recurrent_kernel`` (the per-token step over a segment of tokens, one
  program per (segment, head, Dv tile); ``tl.sum`` over Dk). Every fp32 ``tl.dot`` uses
  ``input_precision="ieee"`` (no TF32); exp is ``tl.exp``; tiles and warps are fixed constants
  that depend on (Dk, Dv) only, never on T, the batch or the case. Decode launches the same
  prep/state kernels for all lanes; a lane whose chunk is not complete has a chunk count of 0
  on device and its programs store nothing, so decode has no host sync and no data-dependent
  Python control flow (CUDA-graph capturable). Only the loop trip counts and base addresses
  differ between the cases, never the arithmetic.

NOT verified on a GPU by the author (no GPU access when written): the Triton kernels ran only
in the Triton CPU interpreter (fp32). In particular: bitwise equality of varlen / engine split /
decode on the H200 (the GPU tests in tests/kernels/test_gdn_core.py assert it), speed, register
pressure of the prep/state kernels (num_warps 8), and CUDA-graph capture of the decode path.
Known speed gap: the prep kernel inverts (I + A) by 63 row steps of masked reductions over the
64 x 64 tile; a blocked inverse (16 x 16 diagonal blocks merged by ``tl.dot``, as stock chunk
kernels do) should be faster. The native chunk baseline shares this prep kernel (with TF32), so
a faster inverse must go into both or the benchmark flatters CPR.

Memory: the Triton prep writes W, U and k*exp(G_last - G) for every complete chunk (3 x
[chunks, H, C, Dk|Dv] fp32) and pass 1 writes one start state per chunk ([chunks, H, Dk, Dv]
fp32). Decode allocates the prep scratch for all B lanes every step (3 x [B, H, C, D] fp32,
about 0.8 GB at B=256, H=32, D=128; freed after the step, reused inside a CUDA graph pool).

Backward (trainer): the gradient of a differentiable torch chunk-form evaluation of the same
function (``gdn_core_native.torch_chunk_form``), recomputed in the backward; correct at
tolerance, not on the invariant path (the rollout never differentiates).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from . import _ref
from ._triton_util import jit, next_pow2, tl, want_triton

__all__ = [
    "CHUNK",
    "BLOCK_DV",
    "BLOCK_DK",
    "GDNState",
    "gdn_cpr_varlen",
    "gdn_cpr_engine",
    "gdn_cpr_decode",
    "gdn_cpr_varlen_reference",
    "gdn_cpr_engine_reference",
    "gdn_cpr_decode_reference",
    "gdn_cpr_varlen_triton",
    "gdn_cpr_engine_triton",
    "gdn_cpr_decode_triton",
    "chunk_update_reference",
    "IMPL_REFERENCE",
    "IMPL_TRITON",
]

CHUNK = 64
"""Chunk size C: boundary states sit at positions that are multiples of C."""

BLOCK_DV = 32
"""Dv tile of the Triton state and recurrent kernels (columns of S are independent)."""

BLOCK_DK = 32
"""Dk block of the Triton prep kernel (k.k^T accumulated over Dk blocks in order)."""

IMPL_REFERENCE = "ref_gdn_cpr"
IMPL_TRITON = "triton_gdn_cpr"


# ---------------------------------------------------------------------------------------------
# State
# ---------------------------------------------------------------------------------------------


@dataclass
class GDNState:
    """Recurrent state of one GDN layer for ``S`` engine slots (all fp32 except ``fill``).

    boundary [S, H, Dk, Dv]   state at the last chunk boundary
    running  [S, H, Dk, Dv]   state after the last token (== boundary when fill == 0)
    buf_k    [S, C, H, Dk]    keys of the open chunk, per value head (GQA-expanded)
    buf_v    [S, C, H, Dv]    values of the open chunk
    buf_g    [S, C, H]        log decays of the open chunk
    buf_beta [S, C, H]        betas of the open chunk
    fill     [S] int32        tokens since the last boundary (0 <= fill < C)
    """

    boundary: torch.Tensor
    running: torch.Tensor
    buf_k: torch.Tensor
    buf_v: torch.Tensor
    buf_g: torch.Tensor
    buf_beta: torch.Tensor
    fill: torch.Tensor

    @classmethod
    def allocate(cls, num_slots: int, H: int, Dk: int, Dv: int, device, chunk: int = CHUNK) -> "GDNState":
        f32 = dict(dtype=torch.float32, device=device)
        return cls(
            boundary=torch.zeros(num_slots, H, Dk, Dv, **f32),
            running=torch.zeros(num_slots, H, Dk, Dv, **f32),
            buf_k=torch.zeros(num_slots, chunk, H, Dk, **f32),
            buf_v=torch.zeros(num_slots, chunk, H, Dv, **f32),
            buf_g=torch.zeros(num_slots, chunk, H, **f32),
            buf_beta=torch.zeros(num_slots, chunk, H, **f32),
            fill=torch.zeros(num_slots, dtype=torch.int32, device=device),
        )

    @property
    def chunk(self) -> int:
        return self.buf_k.shape[1]

    def reset_(self, slots: torch.Tensor) -> None:
        """Zero the given slots in place (new sequence, preemption, weight update)."""
        slots = slots.to(device=self.fill.device, dtype=torch.long)
        for f in fields(self):
            getattr(self, f.name).index_fill_(0, slots, 0)


# ---------------------------------------------------------------------------------------------
# Argument checks and host-side planning (shared by both twins)
# ---------------------------------------------------------------------------------------------


def _check(q, k, v, g, beta, name: str) -> tuple[int, int, int, int, int]:
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"{name}: q and k must be [T, Hk, Dk] with the same shape; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}")
    T, Hk, Dk = q.shape
    if v.dim() != 3 or v.shape[0] != T:
        raise ValueError(f"{name}: v must be [T, H, Dv] with T={T}; got {tuple(v.shape)}")
    H, Dv = v.shape[1], v.shape[2]
    if H % Hk:
        raise ValueError(f"{name}: value heads H={H} must be a multiple of key heads Hk={Hk}")
    if g.shape != (T, H) or beta.shape != (T, H):
        raise ValueError(f"{name}: g and beta must be [T, H]=[{T}, {H}]; got g {tuple(g.shape)}, "
                         f"beta {tuple(beta.shape)}")
    if q.dtype not in (torch.float32, torch.float64) or k.dtype != q.dtype:
        raise TypeError(f"{name}: q and k must be float32 (float64 for gradcheck); got {q.dtype}, {k.dtype}")
    if v.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"{name}: v must be bf16/fp16/fp32; got {v.dtype}")
    return T, Hk, Dk, H, Dv


def _check_state(state: GDNState, H: int, Dk: int, Dv: int, chunk: int, name: str) -> None:
    S_, H_, Dk_, Dv_ = state.boundary.shape
    if (H_, Dk_, Dv_) != (H, Dk, Dv) or state.chunk != chunk:
        raise ValueError(f"{name}: state holds H={H_}, Dk={Dk_}, Dv={Dv_}, chunk={state.chunk} but the "
                         f"inputs have H={H}, Dk={Dk}, Dv={Dv}, chunk={chunk}; allocate the state "
                         "with the layer's dimensions")


def _host_lens(cu: torch.Tensor) -> tuple[list[int], list[int]]:
    cu = [int(x) for x in cu.tolist()]
    return cu[:-1], [b - a for a, b in zip(cu[:-1], cu[1:])]


def _float(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


# ---------------------------------------------------------------------------------------------
# Reference twin: building blocks (fixed order, IEEE basic operations only)
# ---------------------------------------------------------------------------------------------


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp rounded once from float64 (position-free, see _ref.exp64)."""
    return _ref.exp64(x.double()).to(x.dtype)


def _sum_dim(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Halves-tree sum over ``dim`` (removed)."""
    return _ref.tree_sum0(t.movedim(dim, 0))


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched ``a [N, M, K] @ b [N, K, P]`` with each dot product by the halves tree over K.
    Rows of N are processed in groups to bound the [n, M, K, P] temporary; groups never mix
    rows, so the grouping does not change bits."""
    N, M, K = a.shape
    P = b.shape[2]
    out = a.new_empty((N, M, P))
    step = _ref.rows_per_chunk(M * K * P, 1 << 22)
    for n0 in range(0, N, step):
        prod = a[n0:n0 + step, :, :, None] * b[n0:n0 + step, None, :, :]
        out[n0:n0 + step] = _sum_dim(prod, 2)
    return out


def _step_reference(S, q, k, v, g, beta):
    """One per-token step for N independent (sequence, head) lanes.
    S [N, Dk, Dv]; q, k [N, Dk]; v [N, Dv]; g, beta [N]. Returns (S', o [N, Dv])."""
    S = S * _exp(g)[:, None, None]
    kv = _sum_dim(S * k[:, :, None], 1)
    delta = (v - kv) * beta[:, None]
    S = S + k[:, :, None] * delta[:, None, :]
    o = _sum_dim(S * q[:, :, None], 1)
    return S, o


def _chunk_prep_reference(K, V, g, beta):
    """The state-independent part of chunk_update for N complete chunks.
    K [N, C, Dk], V [N, C, Dv], g, beta [N, C] -> (W [N, C, Dk], U [N, C, Dv],
    Kd [N, C, Dk], e_last [N])."""
    N, C = g.shape
    G = torch.empty_like(g)
    acc = g.new_zeros(N)
    for t in range(C):
        acc = acc + g[:, t]
        G[:, t] = acc
    idx = torch.arange(C, device=g.device)
    lower = idx[None, :] < idx[:, None]  # [i, j]: j < i
    dG = torch.where(lower, G[:, :, None] - G[:, None, :], torch.zeros_like(G)[:, :, None])
    A = torch.where(lower, (_mm(K, K.transpose(1, 2)) * beta[:, :, None]) * _exp(dG),
                    torch.zeros((), dtype=g.dtype, device=g.device))
    eye = torch.eye(C, dtype=g.dtype, device=g.device)
    Tm = eye.expand(N, C, C).clone()
    for i in range(1, C):
        x = _sum_dim(A[:, i, :, None] * Tm, 1)
        Tm[:, i] = eye[i] - x
    W = _mm(Tm, K * (beta * _exp(G))[:, :, None])
    U = _mm(Tm, V * beta[:, :, None])
    g_last = G[:, C - 1]
    Kd = K * _exp(g_last[:, None] - G)[:, :, None]
    return W, U, Kd, _exp(g_last)


def _chunk_state_reference(S, W, U, Kd, e_last):
    """B_{c+1} from B_c = S [N, Dk, Dv] and the prep of the chunk."""
    Vnew = U - _mm(W, S)
    return S * e_last[:, None, None] + _mm(Kd.transpose(1, 2), Vnew)


def chunk_update_reference(S, K, V, g, beta):
    """``chunk_update`` of the module docstring for N lanes: S [N, Dk, Dv], K [N, C, Dk],
    V [N, C, Dv], g, beta [N, C] -> S' [N, Dk, Dv]."""
    return _chunk_state_reference(S, *_chunk_prep_reference(K, V, g, beta))


def _core_reference(q, k, v, g, beta, starts, lens, init, chunk):
    """CPR over B segments of the rows of q/k/v/g/beta, each starting on a chunk boundary.

    q, k [T, H, Dk] (already one row per value head), v [T, H, Dv], g, beta [T, H], all in the
    compute dtype; init [B, H, Dk, Dv] or None (zeros). Returns (o [T, H, Dv], boundary after
    the last complete chunk [B, H, Dk, Dv], state after the last token [B, H, Dk, Dv])."""
    T, H, Dk = k.shape
    Dv = v.shape[2]
    B = len(lens)
    dt = v.dtype
    dev = v.device
    C = chunk
    n_chunks = [(n + C - 1) // C for n in lens]
    nc = max(n_chunks + [1])
    Lp = nc * C
    # padded [B, Lp] gather (padding rows are zeros and never read back)
    src = torch.full((B, Lp), T, dtype=torch.long)
    for b, (s, n) in enumerate(zip(starts, lens)):
        src[b, :n] = torch.arange(s, s + n)
    src = src.to(dev).view(-1)

    def pad(x):
        xz = torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))])
        # [B, nc, C, H, ...] -> [B, H, nc, C, ...]
        y = xz.index_select(0, src).view(B, nc, C, *x.shape[1:])
        return y.movedim(3, 1).contiguous()

    qp, kp, vp, gp, bp = pad(q), pad(k), pad(v), pad(g), pad(beta)
    S = init.clone() if init is not None else torch.zeros(B, H, Dk, Dv, dtype=dt, device=dev)
    # pass 1: boundary chain
    n_full = torch.tensor([n // C for n in lens], device=dev)
    max_full = max([n // C for n in lens] + [0])
    starts_state = torch.empty(B, H, nc, Dk, Dv, dtype=dt, device=dev)
    starts_state[:, :, 0] = S
    if max_full:
        W, U, Kd, el = _chunk_prep_reference(
            kp[:, :, :max_full].reshape(-1, C, Dk), vp[:, :, :max_full].reshape(-1, C, Dv),
            gp[:, :, :max_full].reshape(-1, C), bp[:, :, :max_full].reshape(-1, C))
        W, U, Kd, el = (x.view(B, H, max_full, *x.shape[1:]) for x in (W, U, Kd, el))
        for c in range(max_full):
            S_next = _chunk_state_reference(S.reshape(-1, Dk, Dv), W[:, :, c].reshape(-1, C, Dk),
                                            U[:, :, c].reshape(-1, C, Dv), Kd[:, :, c].reshape(-1, C, Dk),
                                            el[:, :, c].reshape(-1)).view(B, H, Dk, Dv)
            S = torch.where((c < n_full)[:, None, None, None], S_next, S)
            if c + 1 < nc:
                starts_state[:, :, c + 1] = S
    boundary = S
    # pass 2: every chunk's in-chunk recurrence, all chunks at once
    St = starts_state.reshape(-1, Dk, Dv)
    o = torch.empty(B, H, nc, C, Dv, dtype=dt, device=dev)
    last = torch.full((B,), -1, dtype=torch.long)
    for b, n in enumerate(lens):
        if n % C:
            last[b] = n % C - 1
    last = last.to(dev)
    running = boundary.clone()
    for t in range(C):
        St, ot = _step_reference(St, qp[:, :, :, t].reshape(-1, Dk), kp[:, :, :, t].reshape(-1, Dk),
                                 vp[:, :, :, t].reshape(-1, Dv), gp[:, :, :, t].reshape(-1),
                                 bp[:, :, :, t].reshape(-1))
        o[:, :, :, t] = ot.view(B, H, nc, Dv)
        if bool((last == t).any()):
            idx = torch.tensor([b * H * nc + h * nc + (lens[b] - 1) // C for b in range(B) if int(last[b]) == t
                                for h in range(H)], device=dev)
            sel = [b for b in range(B) if int(last[b]) == t]
            running[sel] = St.index_select(0, idx).view(len(sel), H, Dk, Dv)
    # unpad
    o = o.movedim(1, 3).reshape(B * Lp, H, Dv)
    keep = torch.cat([torch.arange(n) + b * Lp for b, n in enumerate(lens)] + [torch.zeros(0, dtype=torch.long)])
    out = torch.empty(T, H, Dv, dtype=dt, device=dev)
    dst = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)] + [torch.zeros(0, dtype=torch.long)])
    out[dst.to(dev)] = o.index_select(0, keep.to(dev))
    return out, boundary, running


def _compute_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _expand_heads(x, rep):
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def gdn_cpr_varlen_reference(q, k, v, g, beta, cu_seqlens, *, chunk: int = CHUNK) -> torch.Tensor:
    """Trainer case by the reference schedule (forward only)."""
    T, Hk, Dk, H, Dv = _check(q, k, v, g, beta, "gdn_cpr_varlen_reference")
    dt = _compute_dtype(q)
    starts, lens = _host_lens(cu_seqlens)
    rep = H // Hk
    o, _, _ = _core_reference(_expand_heads(_float(q, dt), rep), _expand_heads(_float(k, dt), rep),
                              _float(v, dt), _float(g, dt), _float(beta, dt), starts, lens, None, chunk)
    return o


def _virtual_rows(state, slots_l, fills, starts, lens, chunk):
    """Index lists that lay out, per sequence b, the buffered prefix (fills[b] rows of slot
    slots_l[b]) followed by its new rows: returns (vstarts, vlens, new_dst, new_src, pre_dst,
    pre_slot, pre_pos)."""
    vstarts, vlens = [], []
    new_dst, new_src, pre_dst, pre_slot, pre_pos = [], [], [], [], []
    pos = 0
    for b, (s, n) in enumerate(zip(starts, lens)):
        f = fills[b]
        vstarts.append(pos)
        vlens.append(f + n)
        pre_dst += range(pos, pos + f)
        pre_slot += [slots_l[b]] * f
        pre_pos += range(f)
        new_dst += range(pos + f, pos + f + n)
        new_src += range(s, s + n)
        pos += f + n
    return vstarts, vlens, new_dst, new_src, pre_dst, pre_slot, pre_pos


def _write_back(state, slots_l, vlens, vstarts, boundary, running, kv, vv, gv, bv, chunk):
    """Store per-sequence results into the state slots (sequences with no tokens untouched).
    kv [T', H, Dk], vv [T', H, Dv], gv, bv [T', H] are the virtual rows."""
    dev = state.fill.device
    for b, (slot, L, s0) in enumerate(zip(slots_l, vlens, vstarts)):
        if L == 0:
            continue
        state.boundary[slot] = boundary[b]
        state.running[slot] = running[b]
        r = L % chunk
        if r:
            a = s0 + L - r
            state.buf_k[slot, :r] = kv[a:a + r]
            state.buf_v[slot, :r] = vv[a:a + r]
            state.buf_g[slot, :r] = gv[a:a + r]
            state.buf_beta[slot, :r] = bv[a:a + r]
        state.fill[slot] = torch.tensor(r, dtype=torch.int32, device=dev)


def gdn_cpr_engine_reference(q, k, v, g, beta, cu_seqlens_q, slots, state: GDNState, *,
                             chunk: int = CHUNK) -> torch.Tensor:
    """Engine prefill by the reference schedule; updates ``state`` in place."""
    T, Hk, Dk, H, Dv = _check(q, k, v, g, beta, "gdn_cpr_engine_reference")
    _check_state(state, H, Dk, Dv, chunk, "gdn_cpr_engine_reference")
    rep = H // Hk
    dt = torch.float32
    dev = v.device
    starts, lens = _host_lens(cu_seqlens_q)
    slots_l = [int(s) for s in slots.tolist()]
    fills = [int(state.fill[s]) for s in slots_l]
    vstarts, vlens, new_dst, new_src, pre_dst, pre_slot, pre_pos = _virtual_rows(
        state, slots_l, fills, starts, lens, chunk)
    Tv = sum(vlens)
    ix = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
    nd, ns, pd, ps, pp = ix(new_dst), ix(new_src), ix(pre_dst), ix(pre_slot), ix(pre_pos)
    kv_ = torch.zeros(Tv, H, Dk, dtype=dt, device=dev)
    qv_ = torch.zeros(Tv, H, Dk, dtype=dt, device=dev)
    vv_ = torch.zeros(Tv, H, Dv, dtype=dt, device=dev)
    gv_ = torch.zeros(Tv, H, dtype=dt, device=dev)
    bv_ = torch.zeros(Tv, H, dtype=dt, device=dev)
    kv_[nd] = _expand_heads(_float(k, dt), rep)[ns]
    qv_[nd] = _expand_heads(_float(q, dt), rep)[ns]
    vv_[nd] = _float(v, dt)[ns]
    gv_[nd] = _float(g, dt)[ns]
    bv_[nd] = _float(beta, dt)[ns]
    if pre_dst:
        kv_[pd] = state.buf_k[ps, pp]
        vv_[pd] = state.buf_v[ps, pp]
        gv_[pd] = state.buf_g[ps, pp]
        bv_[pd] = state.buf_beta[ps, pp]
    init = state.boundary.index_select(0, ix(slots_l)) if slots_l else None
    o_v, boundary, running = _core_reference(qv_, kv_, vv_, gv_, bv_, vstarts, vlens, init, chunk)
    _write_back(state, slots_l, vlens, vstarts, boundary, running, kv_, vv_, gv_, bv_, chunk)
    out = torch.empty(T, H, Dv, dtype=dt, device=dev)
    out[ns] = o_v[nd]
    return out


def gdn_cpr_decode_reference(q, k, v, g, beta, slots, state: GDNState, *, chunk: int = CHUNK) -> torch.Tensor:
    """Engine decode (one token per lane) by the reference schedule; updates ``state``."""
    B, Hk, Dk, H, Dv = _check(q, k, v, g, beta, "gdn_cpr_decode_reference")
    _check_state(state, H, Dk, Dv, chunk, "gdn_cpr_decode_reference")
    rep = H // Hk
    dt = torch.float32
    slots = slots.to(device=v.device, dtype=torch.long)
    kx = _expand_heads(_float(k, dt), rep)
    qx = _expand_heads(_float(q, dt), rep)
    vf, gf, bf = _float(v, dt), _float(g, dt), _float(beta, dt)
    S = state.running.index_select(0, slots)
    S, o = _step_reference(S.reshape(-1, Dk, Dv), qx.reshape(-1, Dk), kx.reshape(-1, Dk), vf.reshape(-1, Dv),
                           gf.reshape(-1), bf.reshape(-1))
    state.running[slots] = S.view(B, H, Dk, Dv)
    f = state.fill.index_select(0, slots).long().clamp(max=chunk - 1)
    state.buf_k[slots, f] = kx
    state.buf_v[slots, f] = vf
    state.buf_g[slots, f] = gf
    state.buf_beta[slots, f] = bf
    f1 = f + 1
    full = f1 == chunk
    if bool(full.any()):
        sl = slots[full]
        n = sl.shape[0]
        Bn = chunk_update_reference(
            state.boundary.index_select(0, sl).reshape(-1, Dk, Dv),
            state.buf_k.index_select(0, sl).movedim(2, 1).reshape(-1, chunk, Dk),
            state.buf_v.index_select(0, sl).movedim(2, 1).reshape(-1, chunk, Dv),
            state.buf_g.index_select(0, sl).movedim(2, 1).reshape(-1, chunk),
            state.buf_beta.index_select(0, sl).movedim(2, 1).reshape(-1, chunk)).view(n, H, Dk, Dv)
        state.boundary[sl] = Bn
        state.running[sl] = Bn
    state.fill[slots] = torch.where(full, torch.zeros_like(f1), f1).to(torch.int32)
    return o.view(B, H, Dv)


# ---------------------------------------------------------------------------------------------
# Triton twin: kernels
# ---------------------------------------------------------------------------------------------


@jit
def _gdn_prep_kernel(
    k_ptr, v_ptr, g_ptr, b_ptr, row0_ptr, nrow_ptr,
    w_ptr, u_ptr, kd_ptr, el_ptr,
    H, REP, DK, DV, s_kt, s_kh, s_vt, s_vh, s_gt, s_bt,
    C: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr,
):
    # One program per (chunk p, value head h). nrow[p] valid rows (the rest are zero: g = 0,
    # beta = 0, k = 0, which leaves the state untouched); nrow == 0 -> the program stores nothing.
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
        # T = (I + A)^-1 by forward substitution: row i = e_i - sum_j A[i, j] T[j, :]
        Tm = tl.where(i2 == j2, 1.0, 0.0)
        for i in range(1, C):
            a_i = tl.sum(tl.where(i2 == i, A, 0.0), axis=0)
            x = tl.sum(a_i[:, None] * Tm, axis=0)
            Tm = tl.where(i2 == i, (tl.where(t == i, 1.0, 0.0) - x)[None, :], Tm)
        g_last = tl.sum(tl.where(t == C - 1, G, 0.0), axis=0)
        coef = beta * tl.exp(G)
        tail = tl.exp(g_last - G)
        base = (p * H + h) * C
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
    c0 = tl.load(chunk0_ptr + p).to(tl.int64)
    ii = tl.load(init_idx_ptr + p).to(tl.int64)
    s0 = tl.load(starts0_ptr + p).to(tl.int64)
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
    DKP: tl.constexpr, BV: tl.constexpr,
):
    # One program per (segment p, head h, Dv tile): S = init[init_idx] (zeros if < 0), then the
    # per-token step for rows row0 .. row0 + nrow - 1 (output row = input row); finally
    # fin[fin_idx] = S if fin_idx >= 0. init and fin may alias (one program owns its tile).
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
    for i in range(0, n):
        r = r0 + i
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


# ---------------------------------------------------------------------------------------------
# Triton twin: launchers (shared with gdn_core_native, which passes its own precision/flags)
# ---------------------------------------------------------------------------------------------


def tile_constants(Dk: int, Dv: int) -> dict:
    """Triton tiles and warps, a function of (Dk, Dv) only (pinned; never of T or batch)."""
    return dict(DKP=max(16, next_pow2(Dk)), DVP=max(16, next_pow2(Dv)),
                BK=min(BLOCK_DK, max(16, next_pow2(Dk))), BV=min(BLOCK_DV, max(16, next_pow2(Dv))),
                prep_warps=8, state_warps=8, rec_warps=4)


def _i32(xs, dev) -> torch.Tensor:
    return torch.tensor(list(xs), dtype=torch.int32, device=dev)


def launch_prep(k, v, g, beta, row0, nrow, H, rep, chunk, prec="ieee"):
    """Prep for P chunks (row0/nrow int32 device tensors [P]); k [*, Hk, Dk] (rows by token),
    v [*, H, Dv], g, beta [*, H], last dims contiguous. Returns (W, U, Kd, e_last)."""
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
            k, v, g, beta, row0, nrow, W, U, Kd, el, H, rep, Dk, Dv,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
            C=chunk, DKP=tc["DKP"], DVP=tc["DVP"], BK=tc["BK"], BV=tc["BV"], PREC=prec,
            num_warps=tc["prep_warps"])
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


def launch_recurrent(q, k, v, g, beta, o, init, fin, row0, nrow, init_idx, fin_idx, H, rep):
    """Per-token recurrence over P segments (index tensors int32 [P]); see the kernel."""
    Dk, Dv = k.shape[-1], v.shape[-1]
    P = row0.shape[0]
    tc = tile_constants(Dk, Dv)
    if P:
        grid = (P, H, triton_cdiv(Dv, tc["BV"]))
        _gdn_recurrent_kernel[grid](
            q, k, v, g, beta, o, init, fin, row0, nrow, init_idx, fin_idx, H, rep, Dk, Dv,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), beta.stride(0), o.stride(0), o.stride(1),
            DKP=tc["DKP"], BV=tc["BV"], num_warps=tc["rec_warps"])


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _rows3(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def _core_triton(q, k, v, g, beta, starts, lens, init, rep, chunk):
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
    prep = launch_prep(k, v, g, beta, _i32(p_row0, dev), _i32([C] * P, dev), H, rep, C)
    init_t = init if init is not None else torch.zeros(1, H, Dk, Dv, dtype=torch.float32, device=dev)
    boundary = (init.clone() if init is not None
                else torch.zeros(B, H, Dk, Dv, dtype=torch.float32, device=dev))
    starts_t = torch.empty(max(n_starts, 1), H, Dk, Dv, dtype=torch.float32, device=dev)
    launch_state(prep, init_t, starts_t, boundary, boundary, _i32(chunk0, dev), _i32(nchunk, dev),
                 _i32(range(B) if init is not None else [-1] * B, dev), _i32(starts0, dev),
                 _i32(range(B), dev), _i32([-1] * B, dev), C)
    o = torch.empty(T, H, Dv, dtype=torch.float32, device=dev)
    running = boundary.clone()
    launch_recurrent(q, k, v, g, beta, o, starts_t, running, _i32(seg_row0, dev), _i32(seg_n, dev),
                     _i32(seg_init, dev), _i32(seg_fin, dev), H, rep)
    return o, boundary, running


def gdn_cpr_varlen_triton(q, k, v, g, beta, cu_seqlens, *, chunk: int = CHUNK) -> torch.Tensor:
    """Trainer case by the Triton kernels (forward only). CUDA, or CPU under the interpreter."""
    T, Hk, Dk, H, Dv = _check(q, k, v, g, beta, "gdn_cpr_varlen_triton")
    starts, lens = _host_lens(cu_seqlens)
    o, _, _ = _core_triton(q, k, v, g, beta, starts, lens, None, H // Hk, chunk)
    return o


def gdn_cpr_engine_triton(q, k, v, g, beta, cu_seqlens_q, slots, state: GDNState, *,
                          chunk: int = CHUNK) -> torch.Tensor:
    """Engine prefill by the Triton kernels; updates ``state`` in place. One host sync (the
    slots' fill counts and the sequence lengths plan the launch)."""
    T, Hk, Dk, H, Dv = _check(q, k, v, g, beta, "gdn_cpr_engine_triton")
    _check_state(state, H, Dk, Dv, chunk, "gdn_cpr_engine_triton")
    rep = H // Hk
    dev = v.device
    starts, lens = _host_lens(cu_seqlens_q)
    slots_l = [int(s) for s in slots.tolist()]
    fills = [int(x) for x in state.fill.index_select(0, slots.to(dev).long()).tolist()] if slots_l else []
    slots_t = torch.tensor(slots_l, dtype=torch.long, device=dev)
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
        ix = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
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
    o_v, boundary, running = _core_triton(qv_, kv_, vv_, gv_, bv_, vstarts, vlens, init, rep, chunk)
    # state write-back (buffers hold the trailing partial chunk, k expanded per value head)
    keep = [b for b, L in enumerate(vlens) if L > 0]
    if keep:
        kb = torch.tensor(keep, dtype=torch.long, device=dev)
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
            ix = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
            bs, bp, br = ix(b_slot), ix(b_pos), ix(b_row)
            state.buf_k[bs, bp] = kv_[br].float().repeat_interleave(rep, dim=1)
            state.buf_v[bs, bp] = vv_[br].float()
            state.buf_g[bs, bp] = gv_[br].float()
            state.buf_beta[bs, bp] = bv_[br].float()
        state.fill.index_copy_(0, sl, torch.tensor(rem, dtype=torch.int32, device=dev))
    if new_dst is None:
        return o_v
    out = torch.empty(T, H, Dv, dtype=torch.float32, device=dev)
    out[ns] = o_v[nd]
    return out


def gdn_cpr_decode_triton(q, k, v, g, beta, slots, state: GDNState, *, chunk: int = CHUNK) -> torch.Tensor:
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
    launch_recurrent(q, k, v, g, beta, o, state.running, state.running, lanes, one, slots32, slots32, H, rep)
    tc = tile_constants(Dk, Dv)
    if B:
        _gdn_append_kernel[(B, H)](
            k, v, g, beta, slots32, state.fill, state.buf_k, state.buf_v, state.buf_g, state.buf_beta,
            H, rep, Dk, Dv, k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
            C=chunk, DKP=tc["DKP"], DVP=tc["DVP"], num_warps=1)
    sl = slots32.long()
    f1 = state.fill.index_select(0, sl).clamp(max=chunk - 1) + 1
    full = (f1 == chunk).to(torch.int32)
    # resync: the buffered chunk of each lane is rows [slot * C, slot * C + C) of the buffers
    bk = state.buf_k.view(-1, H, Dk)
    bv = state.buf_v.view(-1, H, Dv)
    bg = state.buf_g.view(-1, H)
    bb = state.buf_beta.view(-1, H)
    prep = launch_prep(bk, bv, bg, bb, slots32 * chunk, full * chunk, H, 1, chunk)
    launch_state(prep, state.boundary, state.boundary, state.boundary, state.running, lanes, full, slots32,
                 torch.full_like(lanes, -1), slots32, slots32, chunk)
    state.fill.index_put_((sl,), (f1 * (1 - full)).to(torch.int32))
    return o


# ---------------------------------------------------------------------------------------------
# Dispatchers and autograd
# ---------------------------------------------------------------------------------------------


def _varlen_forward(q, k, v, g, beta, cu_seqlens, chunk):
    if want_triton(v):
        return gdn_cpr_varlen_triton(q, k, v, g, beta, cu_seqlens, chunk=chunk)
    return gdn_cpr_varlen_reference(q, k, v, g, beta, cu_seqlens, chunk=chunk)


def chunk_form_backward(inputs, cu_seqlens, chunk, grad_out):
    """Gradients of the torch chunk form (``gdn_core_native.torch_chunk_form``) at ``inputs``
    = (q, k, v, g, beta): the backward of every trainer path of this package."""
    from .gdn_core_native import torch_chunk_form

    with torch.enable_grad():
        xs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
        o = torch_chunk_form(*xs, cu_seqlens, chunk=chunk)
        want = [x for x, orig in zip(xs, inputs) if orig.requires_grad]
        grads = torch.autograd.grad(o, want, grad_out.to(o.dtype), allow_unused=True)
    it = iter(grads)
    out = []
    for x, orig in zip(xs, inputs):
        if orig.requires_grad:
            gr = next(it)
            out.append(torch.zeros_like(orig) if gr is None else gr.to(orig.dtype))
        else:
            out.append(None)
    return out


class _CPRVarlenFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, cu_seqlens, chunk):
        ctx.save_for_backward(q, k, v, g, beta, cu_seqlens)
        ctx.chunk = chunk
        ctx.req = [x.requires_grad for x in (q, k, v, g, beta)]
        return _varlen_forward(q, k, v, g, beta, cu_seqlens, chunk)

    @staticmethod
    def backward(ctx, do):
        q, k, v, g, beta, cu = ctx.saved_tensors
        inputs = [x.detach().requires_grad_(r) for x, r in zip((q, k, v, g, beta), ctx.req)]
        grads = chunk_form_backward(inputs, cu, ctx.chunk, do)
        return (*grads, None, None)


def gdn_cpr_varlen(q, k, v, g, beta, cu_seqlens, *, chunk: int = CHUNK) -> torch.Tensor:
    """Trainer case: sequences ``cu_seqlens[b]:cu_seqlens[b+1]`` each from the zero state;
    returns o [T, H, Dv] fp32. Differentiable w.r.t. q, k, v, g, beta. Schedule: module
    docstring (Triton on CUDA, reference elsewhere)."""
    _check(q, k, v, g, beta, "gdn_cpr_varlen")
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta)):
        return _CPRVarlenFn.apply(q, k, v, g, beta, cu_seqlens, chunk)
    return _varlen_forward(q, k, v, g, beta, cu_seqlens, chunk)


def gdn_cpr_engine(q, k, v, g, beta, cu_seqlens_q, slots, state: GDNState, *, chunk: int = CHUNK) -> torch.Tensor:
    """Engine prefill: any number of new tokens per sequence (``cu_seqlens_q``), sequence b
    continuing from state slot ``slots[b]``; updates ``state`` in place, returns o [T, H, Dv]
    fp32. Bitwise equal to the trainer rows of the same positions."""
    with torch.no_grad():
        if want_triton(v):
            return gdn_cpr_engine_triton(q, k, v, g, beta, cu_seqlens_q, slots, state, chunk=chunk)
        return gdn_cpr_engine_reference(q, k, v, g, beta, cu_seqlens_q, slots, state, chunk=chunk)


def gdn_cpr_decode(q, k, v, g, beta, slots, state: GDNState, *, chunk: int = CHUNK) -> torch.Tensor:
    """Engine decode: one token per lane (q, k [B, Hk, Dk], v [B, H, Dv], g, beta [B, H]) from
    slot ``slots[b]``; updates ``state`` (resync at chunk completion), returns o [B, H, Dv] fp32.
    Padded lanes point at a scratch slot and touch only that slot. CUDA-graph capturable on GPU."""
    with torch.no_grad():
        if want_triton(v):
            return gdn_cpr_decode_triton(q, k, v, g, beta, slots, state, chunk=chunk)
        return gdn_cpr_decode_reference(q, k, v, g, beta, slots, state, chunk=chunk)
