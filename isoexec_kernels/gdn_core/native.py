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
CUDA: Triton kernels. The chunk path, by ``NATIVE_CHUNK_KIND``:
  "wy" (default): the stock-style WY/UT forward of ``native_wy.py`` (blocked inverse of I + A,
  bf16 operands with fp32 accumulation for bf16 values, three kernels; chunks of 16, 32 or 64,
  other sizes fall back to "legacy");
  "legacy": the prep and state kernels of CPR (``triton_kernels.py``) with
  ``NATIVE_DOT_PRECISION`` (TF32) plus the output kernel below (kept so a GPU sweep can time
  the two in one run).
The recurrent path runs CPR's per-token kernel over whole sequences; decode
(``gdn_recurrent_decode``) is that kernel for one token: one program per (lane, head, Dv tile)
that reads its state tile once, steps, and writes it back in place. Backward on CUDA (trainer), by
``NATIVE_BWD_KIND``: "wy" (default, chunk path only): the WY backward of ``native_wy_backward.py``
at the forward's rounding (bf16 operands for bf16 values); "shared": the gradient of
``torch_chunk_form`` by the fused Triton backward of ``chunk_backward.py``, CPR's backward (the
recurrent composition always takes it). All of them ran on the H200 (``docs/cpr.md``).
"""

from __future__ import annotations

import torch

from .._empty import no_token
from .._triton_util import jit, tl, want_triton
from .chunk_form import chunk_form_backward, torch_chunk_form, torch_recurrence
from .plan import HostPlan, _check, _host_lens, chunk_plan, engine_layout
from .native_wy import WY_CHUNKS, wy_chunk_triton
from .state import CHUNK, GDNState
from .triton_kernels import _i32, _rows3, launch_prep, launch_recurrent, launch_state, tile_constants, triton_cdiv


NATIVE_DOT_PRECISION = "tf32"
"""``tl.dot`` precision of the native chunk kernels on CUDA (Triton's default for fp32)."""
NATIVE_INV_BS = 0
"""How the legacy native chunk prep inverts I + A (``launch_prep``'s ``inv_bs``): 0 row by row, 16
by diagonal blocks merged by dots; ``scripts/cpr_variant_sweep.py`` times both."""
NATIVE_CHUNK_KIND = "wy"
"""The native chunk forward on CUDA: "wy" (``native_wy.py``) or "legacy" (CPR's prep and state
kernels at TF32 plus ``_native_chunk_out_kernel``)."""
NATIVE_BWD_KIND = "wy"
"""The native chunk trainer's backward on CUDA: "wy" (``native_wy_backward.py``, the gradient of
the WY forward's function at its rounding) or "shared" (``chunk_backward.py``, CPR's backward)."""


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


def _chunk_triton(q, k, v, g, beta, starts, lens, init, fin, fin_idx, chunk, kind=None):
    """Native chunk forward over B segments with chunks starting at each segment's start.
    init [*, H, Dk, Dv] read at index b (or zeros if None); the final state of segment b is
    written to fin[fin_idx[b]] (fin_idx < 0: not written). Returns o [T, H, Dv] fp32.
    ``kind``: "wy" or "legacy" (default ``NATIVE_CHUNK_KIND``)."""
    kind = kind or NATIVE_CHUNK_KIND
    if kind not in ("wy", "legacy"):
        raise ValueError(f"native chunk kind must be 'wy' or 'legacy'; got {kind!r}")
    if kind == "wy" and chunk in WY_CHUNKS:
        return wy_chunk_triton(q, k, v, g, beta, starts, lens, init, fin, fin_idx, chunk)
    return _chunk_triton_legacy(q, k, v, g, beta, starts, lens, init, fin, fin_idx, chunk)


def _chunk_triton_legacy(q, k, v, g, beta, starts, lens, init, fin, fin_idx, chunk, prec=None):
    """The legacy native chunk forward (CPR's prep and state kernels at TF32, the output kernel
    above); same arguments as ``_chunk_triton``."""
    prec = prec or NATIVE_DOT_PRECISION
    T, Hk, Dk = k.shape
    H, Dv = v.shape[1], v.shape[2]
    rep = H // Hk
    dev = v.device
    C = chunk
    q, k, v = _rows3(q), _rows3(k), _rows3(v)
    g, beta = g.contiguous(), beta.contiguous()
    row0, nrow, sidx, chunk0, nchunk, starts0, n_states = chunk_plan(starts, lens, C)
    B = len(lens)
    i32 = _i32
    prep = launch_prep(k, v, g, beta, i32(row0, dev), i32(nrow, dev), H, rep, C, prec=prec, inv_bs=NATIVE_INV_BS)
    vnew = torch.empty_like(prep[1])
    init_t = init if init is not None else torch.zeros(1, H, Dk, Dv, dtype=torch.float32, device=dev)
    starts_t = torch.empty(max(n_states, 1), H, Dk, Dv, dtype=torch.float32, device=dev)
    if fin is None:
        fin = init_t
        fin_idx = [-1] * B
    launch_state(prep, init_t, starts_t, fin, fin, i32(chunk0, dev), i32(nchunk, dev),
                      i32(range(B) if init is not None else [-1] * B, dev), i32(starts0, dev),
                      i32(fin_idx, dev), i32([-1] * B, dev), C, prec=prec, vnew=vnew)
    o = torch.empty(T, H, Dv, dtype=torch.float32, device=dev)
    P = len(row0)
    if P:
        tc = tile_constants(Dk, Dv)
        _native_chunk_out_kernel[(P, H, triton_cdiv(Dv, tc["BV"]))](
            q, k, g, vnew, starts_t, o, i32(row0, dev), i32(nrow, dev), i32(sidx, dev),
            H, rep, Dk, Dv, q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0),
            o.stride(0), o.stride(1), C=C, DKP=tc["DKP"], BV=tc["BV"], PREC=prec, num_warps=8)
    return o


def _recurrent_triton(q, k, v, g, beta, starts, lens, init, init_idx, fin, fin_idx):
    """Per-token recurrence over whole segments with CPR's recurrent kernel."""
    T, Hk, Dk = k.shape
    H, Dv = v.shape[1], v.shape[2]
    dev = v.device
    q, k, v = _rows3(q), _rows3(k), _rows3(v)
    g, beta = g.contiguous(), beta.contiguous()
    o = torch.empty(T, H, Dv, dtype=torch.float32, device=dev)
    dummy = torch.zeros(1, H, Dk, Dv, dtype=torch.float32, device=dev)
    i32 = _i32
    launch_recurrent(q, k, v, g, beta, o, init if init is not None else dummy,
                          fin if fin is not None else dummy, i32(starts, dev), i32(lens, dev),
                          i32(init_idx, dev), i32(fin_idx, dev), H, H // Hk)
    return o


class _TritonTrainerFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, cu_seqlens, chunk, kind):
        ctx.save_for_backward(q, k, v, g, beta, cu_seqlens)
        ctx.chunk = chunk
        ctx.kind = kind
        ctx.req = [x.requires_grad for x in (q, k, v, g, beta)]
        return _varlen_triton(q, k, v, g, beta, cu_seqlens, chunk, kind)

    @staticmethod
    def backward(ctx, do):
        q, k, v, g, beta, cu = ctx.saved_tensors
        inputs = [x.detach().requires_grad_(r) for x, r in zip((q, k, v, g, beta), ctx.req)]
        return (*_trainer_backward(inputs, cu, ctx.chunk, do, ctx.kind), None, None, None)


def _trainer_backward(inputs, cu_seqlens, chunk, do, kind, bwd_kind=None):
    """Gradients of the native trainer on CUDA (or CPU tensors under the interpreter): the chunk
    path's own WY backward (``native_wy_backward.py``) when ``bwd_kind`` (default
    ``NATIVE_BWD_KIND``) is "wy" and the chunk size is one the WY kernels take; otherwise (and for
    the recurrent composition, and float64) the shared backward of ``chunk_form_backward``. Each
    gradient has its input's dtype, None where the input needs none."""
    bwd_kind = bwd_kind or NATIVE_BWD_KIND
    if bwd_kind not in ("wy", "shared"):
        raise ValueError(f"native backward kind must be 'wy' or 'shared'; got {bwd_kind!r}")
    return chunk_form_backward(inputs, cu_seqlens, chunk, do, kernels=bwd_kind if kind == "chunk" else "shared")


def _varlen_triton(q, k, v, g, beta, cu_seqlens, chunk, kind):
    starts, lens = _host_lens(cu_seqlens)
    B = len(lens)
    if kind == "chunk":
        return _chunk_triton(q, k, v, g, beta, starts, lens, None, None, [-1] * B, chunk)
    return _recurrent_triton(q, k, v, g, beta, starts, lens, None, [-1] * B, None, [-1] * B)


def _trainer(q, k, v, g, beta, cu_seqlens, chunk, kind):
    T, _, _, H, Dv = _check(q, k, v, g, beta, f"gdn_{kind}_varlen")
    if T == 0:   # no token (an FSDP2 rank's empty pass): no chunk to plan, zero gradients upstream
        return no_token((0, H, Dv), torch.float64 if q.dtype == torch.float64 else torch.float32,
                        q, k, v, g, beta)
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


def _engine(q, k, v, g, beta, cu_seqlens_q, slots, state: GDNState, chunk, kind, triton=None, host=None):
    """Engine prefill of either composition; ``triton`` (default: ``want_triton(v)``) picks the
    Triton kernels (True also for CPU tensors under the interpreter, as the tests run them);
    ``host``: the layout on the host (``plan.HostPlan``; else read back from the device)."""
    T, Hk, Dk, H, Dv = _check(q, k, v, g, beta, f"gdn_{kind}_engine")
    dev = v.device
    if T == 0:   # no new token: no state changes
        return torch.zeros(0, H, Dv, dtype=torch.float32, device=dev)
    starts, lens, slots_l, _ = engine_layout(host, cu_seqlens_q, slots, None, chunk, T, f"gdn_{kind}_engine")
    slots_t = slots.to(device=dev, dtype=torch.long)
    with torch.no_grad():
        if want_triton(v) if triton is None else triton:
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


def gdn_chunk_engine(q, k, v, g, beta, cu_seqlens_q, slots, state: GDNState, *, chunk: int = CHUNK,
                     host: HostPlan | None = None):
    """Engine prefill, native chunk algorithm from ``state.running[slots[b]]`` (chunks start at
    the piece's first token); writes the final state back to ``state.running``. ``host``: the
    layout on the host (``HostPlan``), which spares the readbacks."""
    return _engine(q, k, v, g, beta, cu_seqlens_q, slots, state, chunk, "chunk", host=host)


def gdn_recurrent_engine(q, k, v, g, beta, cu_seqlens_q, slots, state: GDNState, *, chunk: int = CHUNK,
                         host: HostPlan | None = None):
    """Engine prefill by the per-token recurrence from ``state.running[slots[b]]`` (``host`` as
    :func:`gdn_chunk_engine`'s)."""
    return _engine(q, k, v, g, beta, cu_seqlens_q, slots, state, chunk, "recurrent", host=host)


def gdn_recurrent_decode(q, k, v, g, beta, slots, state: GDNState, *, chunk: int = CHUNK) -> torch.Tensor:
    """Engine decode: one fused recurrent step from ``state.running[slots[b]]`` (both native
    compositions). On CUDA: CPR's per-token kernel, in place, no host sync."""
    B, Hk, Dk, H, Dv = _check(q, k, v, g, beta, "gdn_recurrent_decode")
    dev = v.device
    with torch.no_grad():
        if want_triton(v):
            q, k, v = _rows3(q), _rows3(k), _rows3(v)
            s32 = slots.to(device=dev, dtype=torch.int32)
            lanes = torch.arange(B, dtype=torch.int32, device=dev)
            o = torch.empty(B, H, Dv, dtype=torch.float32, device=dev)
            launch_recurrent(q, k, v, g.contiguous(), beta.contiguous(), o, state.running, state.running,
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
