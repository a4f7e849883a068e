"""Stock Gated DeltaNet core: the baselines and negative controls of ``gdn_core`` (CPR).

Same arguments as the CPR API (q, k [T, Hk, Dk] fp32 with q already scaled by Dk^-0.5;
v [T, H, Dv] bf16/fp32; g, beta [T, H] fp32; o [T, H, Dv] fp32). Two compositions:

* "native mixed": the standard chunkwise-parallel algorithm for trainer and prefill
  (``gdn_chunk_varlen``, ``gdn_chunk_engine``: chunks start at the start of each call's piece,
  outputs by intra-chunk matmuls plus the chunk's start state) and a fused recurrent step for
  decode (``gdn_recurrent_decode``). The two round differently, and a prefill split at another
  point changes the chunk grid: this is the mismatch CPR removes.
* "recurrent everywhere": the per-token recurrence for every case (``gdn_recurrent_varlen``,
  ``gdn_recurrent_engine``, ``gdn_recurrent_decode``). Case-consistent, but sequential over all
  tokens of a sequence.

The native engine state is ``GDNState.running`` only (the state after the last token); the
boundary and buffer fields are not used. CPU: stock torch ops (``torch_chunk_form``,
``torch_recurrence``; matmul, cumsum, exp, triangular solve), differentiable by autograd.
CUDA: Triton kernels: the chunk path runs the prep and state kernels of ``gdn_core`` with
``NATIVE_DOT_PRECISION`` (TF32, Triton's default for fp32 ``tl.dot``, what a stock chunk kernel
gets for fp32 inputs) plus the output kernel below; the recurrent path runs ``gdn_core``'s
per-token kernel over whole sequences. Backward on CUDA (trainer): the gradient of
``torch_chunk_form``, recomputed (the same backward as CPR's, so fwd+bwd timings differ only in
the forward). NOT run on a GPU by the author; CPU interpreter only.
"""

from __future__ import annotations

import torch

from . import gdn_core as _cpr
from ._triton_util import jit, tl, want_triton
from .gdn_core import CHUNK, GDNState

__all__ = [
    "NATIVE_DOT_PRECISION",
    "torch_chunk_form",
    "torch_recurrence",
    "gdn_chunk_varlen",
    "gdn_chunk_engine",
    "gdn_recurrent_varlen",
    "gdn_recurrent_engine",
    "gdn_recurrent_decode",
    "IMPL_CHUNK",
    "IMPL_RECURRENT",
]

NATIVE_DOT_PRECISION = "tf32"
"""``tl.dot`` precision of the native chunk kernels on CUDA (Triton's default for fp32)."""

IMPL_CHUNK = "native_gdn_chunk"
IMPL_RECURRENT = "native_gdn_recurrent"


# ---------------------------------------------------------------------------------------------
# Stock torch formulations (CPU path, backward of every trainer path)
# ---------------------------------------------------------------------------------------------


def _pad_seqs(x, starts, lens, width):
    """[T, ...] rows of B segments -> [B, width, ...] zero padded (differentiable)."""
    B = len(lens)
    dev = x.device
    if B == 0:
        return x.new_zeros((0, width) + tuple(x.shape[1:]))
    src = torch.cat([torch.arange(s, s + n, device=dev) for s, n in zip(starts, lens)])
    dst = torch.cat([torch.arange(n, device=dev) + b * width for b, n in enumerate(lens)])
    flat = x.new_zeros((B * width,) + tuple(x.shape[1:]))
    flat = flat.index_copy(0, dst, x.index_select(0, src))
    return flat.view(B, width, *x.shape[1:])


def _unpad_seqs(x, starts, lens, T):
    """[B, width, ...] -> [T, ...] (rows of segment b at starts[b])."""
    B, width = x.shape[:2]
    dev = x.device
    out = x.new_zeros((T,) + tuple(x.shape[2:]))
    if B == 0 or T == 0:
        return out
    src = torch.cat([torch.arange(n, device=dev) + b * width for b, n in enumerate(lens)])
    dst = torch.cat([torch.arange(s, s + n, device=dev) for s, n in zip(starts, lens)])
    return out.index_copy(0, dst, x.reshape(B * width, *x.shape[2:]).index_select(0, src))


def _prepare(q, k, v, g, beta, cu_seqlens, width_multiple):
    starts, lens = _cpr._host_lens(cu_seqlens)
    T, Hk, Dk = k.shape
    H = v.shape[1]
    rep = H // Hk
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    L = max(lens + [1])
    width = -(-L // width_multiple) * width_multiple
    heads = torch.arange(H, device=v.device) // rep  # GQA by indexing
    xs = [_pad_seqs(x.to(dt), starts, lens, width) for x in (q, k, v, g, beta)]
    qp, kp = xs[0][:, :, heads], xs[1][:, :, heads]
    # [B, H, width, ...]
    qp, kp, vp = (x.transpose(1, 2) for x in (qp, kp, xs[2]))
    gp, bp = (x.transpose(1, 2) for x in xs[3:])
    return starts, lens, T, dt, qp, kp, vp, gp, bp


def torch_chunk_form(q, k, v, g, beta, cu_seqlens, *, chunk: int = CHUNK, initial_state=None,
                     output_final_state: bool = False):
    """The chunkwise-parallel gated delta rule with stock torch ops (differentiable).

    Sequences are zero padded to a common multiple of ``chunk`` (padding tokens have g = 0,
    beta = 0, k = 0 and leave the state unchanged). Per chunk: G = cumsum(g); the UT system
    (I + A) with A_ij = beta_i (k_i . k_j) exp(G_i - G_j), j < i, is solved by
    ``torch.linalg.solve_triangular`` for U (values) and W (decayed keys); then sequentially
    Vnew = U - W S, o = (q e^G) S + (q k^T * decay, causal) Vnew,
    S = e^{G_last} S + (k e^{G_last - G})^T Vnew. Returns o [T, H, Dv] (and the final states
    [B, H, Dk, Dv] if asked); computed in fp32 (fp64 for fp64 inputs)."""
    starts, lens, T, dt, qp, kp, vp, gp, bp = _prepare(q, k, v, g, beta, cu_seqlens, chunk)
    B, H, W_, Dk = kp.shape
    Dv = vp.shape[-1]
    C = chunk
    nc = W_ // C
    qc, kc, vc = (x.reshape(B, H, nc, C, -1) for x in (qp, kp, vp))
    gc, bc = gp.reshape(B, H, nc, C), bp.reshape(B, H, nc, C)
    G = gc.cumsum(-1)
    idx = torch.arange(C, device=v.device)
    incl = idx[None, :] <= idx[:, None]
    strict = idx[None, :] < idx[:, None]
    dG = G[..., :, None] - G[..., None, :]
    decay = torch.where(incl, dG, torch.full_like(dG, float("-inf"))).exp()
    A = (bc[..., :, None] * (kc @ kc.transpose(-1, -2))) * decay
    A = torch.where(strict, A, torch.zeros_like(A))
    eye = torch.eye(C, dtype=dt, device=v.device)
    rhs = torch.cat([vc * bc[..., None], kc * (bc * G.exp())[..., None]], dim=-1)
    X = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)
    U, Wk = X[..., :Dv], X[..., Dv:]
    qk = (qc @ kc.transpose(-1, -2)) * decay
    q_dec = qc * G.exp()[..., None]
    g_last = G[..., -1]
    k_tail = kc * (g_last[..., None] - G).exp()[..., None]
    if initial_state is not None:
        S = initial_state.to(dt)
    else:
        S = torch.zeros(B, H, Dk, Dv, dtype=dt, device=v.device)
    outs = []
    for c in range(nc):
        vnew = U[:, :, c] - Wk[:, :, c] @ S
        outs.append(q_dec[:, :, c] @ S + qk[:, :, c] @ vnew)
        S = S * g_last[:, :, c, None, None].exp() + k_tail[:, :, c].transpose(-1, -2) @ vnew
    o = torch.stack(outs, dim=2).reshape(B, H, W_, Dv).transpose(1, 2)
    o = _unpad_seqs(o, starts, lens, T)
    return (o, S) if output_final_state else o


def torch_recurrence(q, k, v, g, beta, cu_seqlens, *, initial_state=None, output_final_state: bool = False):
    """The per-token gated delta rule with stock torch ops (differentiable), all sequences
    stepped together (zero padding leaves a finished sequence's state unchanged)."""
    starts, lens, T, dt, qp, kp, vp, gp, bp = _prepare(q, k, v, g, beta, cu_seqlens, 1)
    B, H, L, Dk = kp.shape
    Dv = vp.shape[-1]
    if initial_state is not None:
        S = initial_state.to(dt)
    else:
        S = torch.zeros(B, H, Dk, Dv, dtype=dt, device=v.device)
    outs = []
    for t in range(L):
        S = S * gp[:, :, t].exp()[..., None, None]
        kt = kp[:, :, t]
        kv = (S * kt[..., None]).sum(-2)
        delta = (vp[:, :, t] - kv) * bp[:, :, t, None]
        S = S + kt[..., None] * delta[..., None, :]
        outs.append((S * qp[:, :, t, :, None]).sum(-2))
    o = torch.stack(outs, dim=2).transpose(1, 2) if outs else vp.new_zeros(B, L, H, Dv)
    o = _unpad_seqs(o, starts, lens, T)
    return (o, S) if output_final_state else o


# ---------------------------------------------------------------------------------------------
# Triton: chunk output kernel and the native forward passes
# ---------------------------------------------------------------------------------------------


@jit
def _native_chunk_out_kernel(
    q_ptr, k_ptr, g_ptr, vn_ptr, starts_ptr, o_ptr, row0_ptr, nrow_ptr, sidx_ptr,
    H, REP, DK, DV, s_qt, s_qh, s_kt, s_kh, s_gt, s_ot, s_oh,
    C: tl.constexpr, DKP: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    # One program per (chunk p, head h, Dv tile): o = (q e^G) S_start + (q k^T * decay) Vnew.
    p = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vt = tl.program_id(2)
    n = tl.load(nrow_ptr + p)
    r0 = tl.load(row0_ptr + p).to(tl.int64)
    si = tl.load(sidx_ptr + p).to(tl.int64)
    kh = h // REP
    t = tl.arange(0, C)
    ok = t < n
    rows = r0 + t
    dk = tl.arange(0, DKP)
    dv = vt * BV + tl.arange(0, BV)
    km = dk[None, :] < DK
    vm = dv[None, :] < DV
    g = tl.load(g_ptr + rows * s_gt + h, mask=ok, other=0.0)
    G = tl.cumsum(g, axis=0)
    Q = tl.load(q_ptr + rows[:, None] * s_qt + kh * s_qh + dk[None, :], mask=ok[:, None] & km, other=0.0)
    K = tl.load(k_ptr + rows[:, None] * s_kt + kh * s_kh + dk[None, :], mask=ok[:, None] & km, other=0.0)
    S = tl.load(starts_ptr + (si * H + h) * DK * DV + dk[:, None] * DV + dv[None, :],
                mask=(dk[:, None] < DK) & vm, other=0.0)
    Vn = tl.load(vn_ptr + ((p * H + h) * C + t[:, None]) * DV + dv[None, :], mask=vm, other=0.0)
    i2 = t[:, None]
    j2 = t[None, :]
    incl = j2 <= i2
    qk = tl.dot(Q, tl.trans(K), input_precision=PREC)
    M = tl.where(incl, qk * tl.exp(tl.where(incl, G[:, None] - G[None, :], 0.0)), 0.0)
    o = tl.dot(Q * tl.exp(G)[:, None], S, input_precision=PREC) + tl.dot(M, Vn, input_precision=PREC)
    tl.store(o_ptr + rows[:, None] * s_ot + h * s_oh + dv[None, :], o, mask=ok[:, None] & vm)


def _chunk_triton(q, k, v, g, beta, starts, lens, init, fin, fin_idx, chunk, prec=None):
    """Native chunk forward over B segments with chunks starting at each segment's start.
    init [*, H, Dk, Dv] read at index b (or zeros if None); the final state of segment b is
    written to fin[fin_idx[b]] (fin_idx < 0: not written). Returns o [T, H, Dv] fp32."""
    prec = prec or NATIVE_DOT_PRECISION
    T, Hk, Dk = k.shape
    H, Dv = v.shape[1], v.shape[2]
    rep = H // Hk
    dev = v.device
    C = chunk
    q, k, v = _cpr._rows3(q), _cpr._rows3(k), _cpr._rows3(v)
    g, beta = g.contiguous(), beta.contiguous()
    row0, nrow, chunk0, nchunk, starts0, sidx = [], [], [], [], [], []
    n_states = 0
    for s, L in zip(starts, lens):
        nch = -(-L // C)
        chunk0.append(len(row0))
        nchunk.append(nch)
        starts0.append(n_states)
        for c in range(nch):
            row0.append(s + c * C)
            nrow.append(min(C, L - c * C))
            sidx.append(n_states + c)
        n_states += nch + 1
    B = len(lens)
    i32 = _cpr._i32
    prep = _cpr.launch_prep(k, v, g, beta, i32(row0, dev), i32(nrow, dev), H, rep, C, prec=prec)
    vnew = torch.empty_like(prep[1])
    init_t = init if init is not None else torch.zeros(1, H, Dk, Dv, dtype=torch.float32, device=dev)
    starts_t = torch.empty(max(n_states, 1), H, Dk, Dv, dtype=torch.float32, device=dev)
    if fin is None:
        fin = init_t
        fin_idx = [-1] * B
    _cpr.launch_state(prep, init_t, starts_t, fin, fin, i32(chunk0, dev), i32(nchunk, dev),
                      i32(range(B) if init is not None else [-1] * B, dev), i32(starts0, dev),
                      i32(fin_idx, dev), i32([-1] * B, dev), C, prec=prec, vnew=vnew)
    o = torch.empty(T, H, Dv, dtype=torch.float32, device=dev)
    P = len(row0)
    if P:
        tc = _cpr.tile_constants(Dk, Dv)
        _native_chunk_out_kernel[(P, H, _cpr.triton_cdiv(Dv, tc["BV"]))](
            q, k, g, vnew, starts_t, o, i32(row0, dev), i32(nrow, dev), i32(sidx, dev),
            H, rep, Dk, Dv, q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0),
            o.stride(0), o.stride(1), C=C, DKP=tc["DKP"], BV=tc["BV"], PREC=prec, num_warps=8)
    return o


def _recurrent_triton(q, k, v, g, beta, starts, lens, init, init_idx, fin, fin_idx):
    """Per-token recurrence over whole segments with gdn_core's recurrent kernel."""
    T, Hk, Dk = k.shape
    H, Dv = v.shape[1], v.shape[2]
    dev = v.device
    q, k, v = _cpr._rows3(q), _cpr._rows3(k), _cpr._rows3(v)
    g, beta = g.contiguous(), beta.contiguous()
    o = torch.empty(T, H, Dv, dtype=torch.float32, device=dev)
    dummy = torch.zeros(1, H, Dk, Dv, dtype=torch.float32, device=dev)
    i32 = _cpr._i32
    _cpr.launch_recurrent(q, k, v, g, beta, o, init if init is not None else dummy,
                          fin if fin is not None else dummy, i32(starts, dev), i32(lens, dev),
                          i32(init_idx, dev), i32(fin_idx, dev), H, H // Hk)
    return o


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


class _TritonTrainerFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, cu_seqlens, chunk, kind):
        ctx.save_for_backward(q, k, v, g, beta, cu_seqlens)
        ctx.chunk = chunk
        ctx.req = [x.requires_grad for x in (q, k, v, g, beta)]
        return _varlen_triton(q, k, v, g, beta, cu_seqlens, chunk, kind)

    @staticmethod
    def backward(ctx, do):
        q, k, v, g, beta, cu = ctx.saved_tensors
        inputs = [x.detach().requires_grad_(r) for x, r in zip((q, k, v, g, beta), ctx.req)]
        return (*_cpr.chunk_form_backward(inputs, cu, ctx.chunk, do), None, None, None)


def _varlen_triton(q, k, v, g, beta, cu_seqlens, chunk, kind):
    starts, lens = _cpr._host_lens(cu_seqlens)
    B = len(lens)
    if kind == "chunk":
        return _chunk_triton(q, k, v, g, beta, starts, lens, None, None, [-1] * B, chunk)
    return _recurrent_triton(q, k, v, g, beta, starts, lens, None, [-1] * B, None, [-1] * B)


def _trainer(q, k, v, g, beta, cu_seqlens, chunk, kind):
    _cpr._check(q, k, v, g, beta, f"gdn_{kind}_varlen")
    if want_triton(v):
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta)):
            return _TritonTrainerFn.apply(q, k, v, g, beta, cu_seqlens, chunk, kind)
        return _varlen_triton(q, k, v, g, beta, cu_seqlens, chunk, kind)
    if kind == "chunk":
        return torch_chunk_form(q, k, v, g, beta, cu_seqlens, chunk=chunk).float() \
            if q.dtype != torch.float64 else torch_chunk_form(q, k, v, g, beta, cu_seqlens, chunk=chunk)
    o = torch_recurrence(q, k, v, g, beta, cu_seqlens)
    return o if q.dtype == torch.float64 else o.float()


def gdn_chunk_varlen(q, k, v, g, beta, cu_seqlens, *, chunk: int = CHUNK) -> torch.Tensor:
    """Trainer case, native chunk algorithm (differentiable)."""
    return _trainer(q, k, v, g, beta, cu_seqlens, chunk, "chunk")


def gdn_recurrent_varlen(q, k, v, g, beta, cu_seqlens, *, chunk: int = CHUNK) -> torch.Tensor:
    """Trainer case, per-token recurrence (differentiable; ``chunk`` only shapes the backward)."""
    return _trainer(q, k, v, g, beta, cu_seqlens, chunk, "recurrent")


def _engine(q, k, v, g, beta, cu_seqlens_q, slots, state: GDNState, chunk, kind):
    T, Hk, Dk, H, Dv = _cpr._check(q, k, v, g, beta, f"gdn_{kind}_engine")
    dev = v.device
    starts, lens = _cpr._host_lens(cu_seqlens_q)
    slots_l = [int(s) for s in slots.tolist()]
    slots_t = torch.tensor(slots_l, dtype=torch.long, device=dev)
    with torch.no_grad():
        if want_triton(v):
            fin_idx = [s if n > 0 else -1 for s, n in zip(slots_l, lens)]
            if kind == "chunk":
                init = state.running.index_select(0, slots_t)
                return _chunk_triton(q, k, v, g, beta, starts, lens, init, state.running, fin_idx, chunk)
            return _recurrent_triton(q, k, v, g, beta, starts, lens, state.running, slots_l, state.running,
                                     fin_idx)
        init = state.running.index_select(0, slots_t)
        fn = torch_chunk_form if kind == "chunk" else torch_recurrence
        kw = dict(chunk=chunk) if kind == "chunk" else {}
        o, S = fn(q, k, v, g, beta, cu_seqlens_q, initial_state=init, output_final_state=True, **kw)
        keep = torch.tensor([b for b, n in enumerate(lens) if n > 0], dtype=torch.long, device=dev)
        state.running.index_copy_(0, slots_t.index_select(0, keep), S.float().index_select(0, keep))
        return o.float()


def gdn_chunk_engine(q, k, v, g, beta, cu_seqlens_q, slots, state: GDNState, *, chunk: int = CHUNK):
    """Engine prefill, native chunk algorithm from ``state.running[slots[b]]`` (chunks start at
    the piece's first token); writes the final state back to ``state.running``."""
    return _engine(q, k, v, g, beta, cu_seqlens_q, slots, state, chunk, "chunk")


def gdn_recurrent_engine(q, k, v, g, beta, cu_seqlens_q, slots, state: GDNState, *, chunk: int = CHUNK):
    """Engine prefill by the per-token recurrence from ``state.running[slots[b]]``."""
    return _engine(q, k, v, g, beta, cu_seqlens_q, slots, state, chunk, "recurrent")


def gdn_recurrent_decode(q, k, v, g, beta, slots, state: GDNState, *, chunk: int = CHUNK) -> torch.Tensor:
    """Engine decode: one fused recurrent step from ``state.running[slots[b]]`` (both native
    compositions). On CUDA: gdn_core's per-token kernel, in place, no host sync."""
    B, Hk, Dk, H, Dv = _cpr._check(q, k, v, g, beta, "gdn_recurrent_decode")
    dev = v.device
    with torch.no_grad():
        if want_triton(v):
            q, k, v = _cpr._rows3(q), _cpr._rows3(k), _cpr._rows3(v)
            s32 = slots.to(device=dev, dtype=torch.int32)
            lanes = torch.arange(B, dtype=torch.int32, device=dev)
            o = torch.empty(B, H, Dv, dtype=torch.float32, device=dev)
            _cpr.launch_recurrent(q, k, v, g.contiguous(), beta.contiguous(), o, state.running, state.running,
                                  lanes, torch.ones_like(lanes), s32, s32, H, H // Hk)
            return o
        sl = slots.to(device=dev, dtype=torch.long)
        heads = torch.arange(H, device=dev) // (H // Hk)
        S = state.running.index_select(0, sl)
        S = S * g.float().exp()[..., None, None]
        kt = k.float()[:, heads]
        kv = (S * kt[..., None]).sum(-2)
        delta = (v.float() - kv) * beta.float()[..., None]
        S = S + kt[..., None] * delta[..., None, :]
        o = (S * q.float()[:, heads][..., None]).sum(-2)
        state.running[sl] = S
        return o
