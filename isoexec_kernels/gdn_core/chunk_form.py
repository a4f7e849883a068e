"""The gated delta rule in stock torch ops, differentiable: the chunkwise-parallel form and the per-
token recurrence. The stock twin runs them on the CPU; every trainer path (CPR's and the stock
twin's) takes its backward from the chunk form (``chunk_form_backward``: the fused Triton backward
of ``chunk_backward.py`` on CUDA, autograd through ``torch_chunk_form`` elsewhere): correct at
tolerance, not on the invariant path (the rollout never differentiates)."""

from __future__ import annotations

import torch

from .padding import _prepare, _unpad_seqs
from .state import CHUNK


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


def _use_triton_backward(q) -> bool:
    """CUDA tensors (``want_triton``), or CPU tensors under ``TRITON_INTERPRET=1``; never float64
    (gradcheck's inputs take the autograd path in their own precision)."""
    from .._triton_util import triton_usable, want_triton

    return q.dtype != torch.float64 and (want_triton(q) or triton_usable(q))


def chunk_form_backward(inputs, cu_seqlens, chunk, grad_out, kernels: str = "shared"):
    """Gradients of the torch chunk form (``chunk_form.torch_chunk_form``) at ``inputs``
    = (q, k, v, g, beta): the backward of every trainer path of this package. CUDA tensors (or
    CPU tensors under the Triton interpreter) take fused Triton kernels, by ``kernels``:
    "shared", those of ``chunk_backward.py`` (tf32x3 dots, fp32 storage); "wy", the WY backward of
    ``native_wy_backward.py`` (the stock kernels' form and rounding: bf16 operands for bf16
    values, TF32 for fp32; chunks of ``WY_CHUNKS`` only, others take "shared"). Both are the
    gradient of one function at different roundings, deterministic run to run (fixed orders, no
    atomics); the forward's bits do not depend on the choice. Other tensors (and float64)
    differentiate ``torch_chunk_form`` by autograd. Each returned gradient has its input's dtype
    (None where the input needs none)."""
    if kernels not in ("shared", "wy"):
        raise ValueError(f"GDN backward kernels must be 'shared' or 'wy'; got {kernels!r}")
    q = inputs[0]
    if q.shape[0] == 0:   # no token (a data-parallel rank holding no sequence): nothing to chunk
        return [torch.zeros_like(x) if x.requires_grad else None for x in inputs]
    if _use_triton_backward(q):
        from .native_wy import WY_CHUNKS

        if kernels == "wy" and chunk in WY_CHUNKS:
            from .native_wy_backward import wy_chunk_backward_triton as backward
        else:
            from .chunk_backward import chunk_backward_triton as backward
        grads = backward(*(x.detach() for x in inputs), cu_seqlens, grad_out.detach(), chunk=chunk)
        return [gr.to(orig.dtype) if orig.requires_grad else None for gr, orig in zip(grads, inputs)]
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
