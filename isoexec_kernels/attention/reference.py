"""Torch reference twin of the batch-invariant attention kernel (CPU path).

Rounding schedule (identical in structure to ``triton_kernels.py``; see ``api.py``):

* Every query row walks the keys of its own sequence in KV blocks of ``BLOCK_N`` = 64 keys at
  ABSOLUTE positions (block j = key positions [64 j, 64 j + 64)), j increasing, and skips the
  blocks that lie wholly after its visibility limit (its absolute position when causal).
* Per block, in fp32: ``s = dot(q, k) * (scale * log2 e)``; invisible keys -> ``-inf``;
  ``m' = max(m, max_n s)``; ``alpha = exp2(m - m')``; ``p = exp2(s - m')``;
  ``l' = l * alpha + sum_n p``; ``acc' = acc * alpha + sum_n (p rounded to the input dtype) * v``.
  Then ``out = acc / l`` rounded once to the input dtype; ``lse2 = m + log2 l`` (log base 2).
* The dot over head_dim and both sums over the 64 keys of a block are binary trees over fixed
  index pairs (``x[:h] + x[h:]``), padded with -0.0 (the neutral element of IEEE addition) to a
  power of two. Inputs are upcast to fp32 first; the products of two bf16/fp16 values are exact
  in fp32.

Why it is invariant on a CPU: every operation is either elementwise (IEEE add/mul/div/max and
casts, which round each element the same way whatever the tensor's size, vector lane or thread
split), a max (exact), or a fixed tree built by slicing along the key / head_dim axes. No
operation ever reduces along the row axis, so a row's bits depend only on its own q, its
sequence's K/V and its visibility limit, never on how many rows are processed together. Stock
``torch.matmul`` / ``torch.sum`` are not used on the invariant path (their blocking depends on
the shape), and neither is ``torch.exp2``: on this CPU it rounds differently in the vectorised
body and the scalar tail of a loop, so an element's bits depend on its index in the tensor.
``exp2_fixed`` below builds exp2 from elementwise operations instead.

``lse2`` (used by the backward only) goes through ``torch.log2`` and is not part of the invariant
contract. The backward here is a plain fp32 torch computation (correct at tolerance, not
invariant); the CUDA path uses the Triton backward in ``triton_kernels.py``.
"""

from __future__ import annotations

import math

import torch

BLOCK_N = 64  # keys per KV block; pinned, shared with the Triton kernel
LOG2E = 1.4426950408889634

# 2**f = exp(f ln 2) for |f| <= 1/2: Taylor coefficients (ln 2)**i / i!, highest degree first.
# Degree 7 leaves a truncation error below 6e-9 relative, under half an fp32 ulp.
_EXP2_COEFFS = [math.log(2.0) ** i / math.factorial(i) for i in range(7, -1, -1)]


def exp2_fixed(x: torch.Tensor) -> torch.Tensor:
    """2**x in fp32 from elementwise IEEE operations only (position- and size-invariant).

    Range reduction x = n + f with n = round(x) (exact) and f = x - n in [-1/2, 1/2] (exact),
    a degree-7 Horner polynomial for 2**f (each step one rounded mul and one rounded add, never
    fused), then scaling by 2**n built from its bit pattern. Results below 2**-126 flush to +0
    (so ``exp2_fixed(-inf) == 0``). Relative error about 2e-7 on the softmax domain x <= 0.
    """
    x = x.float().clamp(min=-200.0, max=127.0)
    n = torch.round(x)
    f = x - n
    # Horner in place (the same roundings as poly * f + c), its first step f * c0 without a filled
    # tensor (c0 * f: one product, either order the same bits)
    poly = torch.mul(f, _EXP2_COEFFS[0]).add_(_EXP2_COEFFS[1])
    for c in _EXP2_COEFFS[2:]:
        poly.mul_(f).add_(c)
    n_int = n.to(torch.int32)
    scale = ((n_int.clamp(min=-126) + 127) << 23).view(torch.float32)
    out = poly.mul_(scale)
    return torch.where(n_int < -126, 0.0, out)


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum along ``dim`` by a fixed binary tree: pad with -0.0 to a power of two, then
    repeatedly add the first half to the second half. Each output element's additions depend
    only on the size of ``dim``, never on the other dimensions."""
    dim = dim % x.dim()
    n = x.shape[dim]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        pad_shape = list(x.shape)
        pad_shape[dim] = width - n
        x = torch.cat([x, torch.full(pad_shape, -0.0, dtype=x.dtype, device=x.device)], dim)
    while width > 1:
        width //= 2
        x = x.narrow(dim, 0, width) + x.narrow(dim, width, width)
    return x.squeeze(dim)


def _exp2_pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exp2_fixed(a), exp2_fixed(b)) by one call on both, half the torch calls: exp2_fixed is
    elementwise, its operations give the same bits on any path, and an element's NaN, if any, is
    only ever its own input's (one payload meets itself), so the concatenation changes no bit."""
    e = exp2_fixed(torch.cat([a.reshape(-1), b.reshape(-1)]))
    return e[:a.numel()].view(a.shape), e[a.numel():].view(b.shape)


def _attend_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     causal: bool, block_n: int = BLOCK_N):
    """Attention of one sequence's queries over its keys.

    q: [Lq, Hq, D] (the last Lq tokens of the sequence), k/v: [ctx, Hkv, D] all keys of the
    sequence. Returns out [Lq, Hq, D] (input dtype) and lse2 [Lq, Hq] (fp32, log base 2).
    """
    lq, hq, d = q.shape
    ctx, hkv, _ = k.shape
    group = hq // hkv
    dtype = q.dtype
    first_pos = ctx - lq
    # rows laid out [Hkv, Lq, G, D]: the group heads sharing one KV head sit together
    qf = q.float().reshape(lq, hkv, group, d).permute(1, 0, 2, 3)
    lim = (torch.arange(lq) + first_pos) if causal else torch.full((lq,), ctx - 1)
    m = torch.full((hkv, lq, group), float("-inf"))
    l = torch.zeros((hkv, lq, group))
    acc = torch.zeros((hkv, lq, group, d))
    qk_scale = torch.tensor(scale * LOG2E, dtype=torch.float32)
    n_blocks = (int(lim.max()) // block_n + 1) if lq > 0 else 0
    for j in range(n_blocks):
        lo = j * block_n
        hi = min(lo + block_n, ctx)
        # the rows that see at least one key of this block: a suffix of the tokens when causal
        t0 = max(0, lo - first_pos) if causal else 0
        kb = torch.zeros((block_n, hkv, d))
        vb = torch.zeros((block_n, hkv, d))
        kb[: hi - lo] = k[lo:hi].float()
        vb[: hi - lo] = v[lo:hi].float()
        kb = kb.permute(1, 0, 2)  # [Hkv, N, D]
        vb = vb.permute(1, 0, 2)
        qa = qf[:, t0:]  # [Hkv, La, G, D]
        s = tree_sum(qa.unsqueeze(3) * kb[:, None, None, :, :], -1)  # [Hkv, La, G, N]
        s = s * qk_scale
        keys = torch.arange(lo, lo + block_n)
        visible = keys[None, :] <= lim[t0:, None]  # [La, N]
        partial = not bool(visible.all())
        s = torch.where(visible[None, :, None, :], s, float("-inf"))
        m_old, l_old, acc_old = m[:, t0:], l[:, t0:], acc[:, t0:]
        m_new = torch.maximum(m_old, s.amax(-1))
        alpha, p = _exp2_pair(m_old - m_new, s - m_new.unsqueeze(-1))
        l_new = l_old * alpha + tree_sum(p, -1)
        p_low = p.to(dtype).float()
        pv = p_low.unsqueeze(-1) * vb[:, None, None, :, :]  # [Hkv, La, G, N, D]
        if partial:  # invisible keys contribute +0 exactly, whatever the sign of their v
            pv = torch.where(visible[None, :, None, :, None], pv, 0.0)
        acc_new = acc_old * alpha.unsqueeze(-1) + tree_sum(pv, -2)
        m[:, t0:], l[:, t0:], acc[:, t0:] = m_new, l_new, acc_new
    out = (acc / l.unsqueeze(-1)).to(dtype)
    lse2 = m + torch.log2(l)
    return out.permute(1, 0, 2, 3).reshape(lq, hq, d), lse2.permute(1, 0, 2).reshape(lq, hq)


def _attend_last_rows(q: torch.Tensor, ks: list, vs: list, scale: float, causal: bool,
                      block_n: int = BLOCK_N):
    """:func:`_attend_sequence` for B sequences of one query each (decode rows), side by side.

    q: [B, Hq, D] (row b the last token of sequence b), ks[b], vs[b]: [ctx_b, Hkv, D] its keys and
    values. Returns out [B, Hq, D] and lse2 [B, Hq], each row with the bits ``_attend_sequence``
    gives it alone: every operation below is that function's on an extra leading dim of
    sequences, elementwise, a max or a fixed tree along the key / head_dim axes of one row, so
    rows never mix. A single row sees every key of its sequence (its limit is ctx_b - 1, causal or
    not), hence every block up to its last one; at the blocks after that, which a longer sequence
    of the batch still walks, the row's m, l and acc are kept as they are (selected, not updated,
    so that each row takes exactly the operations it takes alone). lse2 goes through the
    stock torch.log2, whose bits may depend on a tensor's size: it is taken per sequence, on the
    shape ``_attend_sequence`` takes it on. Two things here do depend on the batch: the sign of a
    zero max (torch.maximum / amax on +0 and -0), which reaches no output (s - m and m_old - m are
    then +-0 or unchanged, exp2_fixed(+-0) = 1, m + log2(l) = log2(l) or +0), and the NaN a max
    returns, which the caller handles (:func:`paged_attention_reference`)."""
    B, hq, d = q.shape
    hkv = ks[0].shape[1]
    group = hq // hkv
    dtype = q.dtype
    ctx = [k.shape[0] for k in ks]
    nbl = [(c - 1) // block_n + 1 for c in ctx]
    L = max(nbl) * block_n
    # each sequence's keys and values zero-padded to the longest one's last block, as
    # _attend_sequence zero-pads a block past the end of its sequence
    kp = torch.zeros((B, L, hkv, d))
    vp = torch.zeros((B, L, hkv, d))
    for b in range(B):
        kp[b, :ctx[b]] = ks[b].float()
        vp[b, :ctx[b]] = vs[b].float()
    qf = q.float().reshape(B, 1, hkv, group, d).permute(0, 2, 1, 3, 4)           # [B, Hkv, 1, G, D]
    lim = torch.tensor([c - 1 for c in ctx])
    nbl_t = torch.tensor(nbl)
    m = torch.full((B, hkv, 1, group), float("-inf"))
    l = torch.zeros((B, hkv, 1, group))
    acc = torch.zeros((B, hkv, 1, group, d))
    qk_scale = torch.tensor(scale * LOG2E, dtype=torch.float32)
    for j in range(max(nbl)):
        lo = j * block_n
        kb = kp[:, lo:lo + block_n].permute(0, 2, 1, 3)                          # [B, Hkv, N, D]
        vb = vp[:, lo:lo + block_n].permute(0, 2, 1, 3)
        s = tree_sum(qf.unsqueeze(4) * kb[:, :, None, None, :, :], -1)             # [B, Hkv, 1, G, N]
        s = s * qk_scale
        keys = torch.arange(lo, lo + block_n)
        visible = keys[None, :] <= lim[:, None]                                    # [B, N]
        s = torch.where(visible[:, None, None, None, :], s, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha, p = _exp2_pair(m - m_new, s - m_new.unsqueeze(-1))
        l_new = l * alpha + tree_sum(p, -1)
        p_low = p.to(dtype).float()
        pv = p_low.unsqueeze(-1) * vb[:, :, None, None, :, :]                      # [B, Hkv, 1, G, N, D]
        if not bool(visible.all()):   # invisible keys contribute +0 exactly (a visible one is kept)
            pv = torch.where(visible[:, None, None, None, :, None], pv, 0.0)
        acc_new = acc * alpha.unsqueeze(-1) + tree_sum(pv, -2)
        live = (j < nbl_t)[:, None, None, None]
        m = torch.where(live, m_new, m)
        l = torch.where(live, l_new, l)
        acc = torch.where(live[..., None], acc_new, acc)
    out = (acc / l.unsqueeze(-1)).to(dtype)
    lse2 = torch.stack([m[b] + torch.log2(l[b].clone()) for b in range(B)])   # each alone, as before
    return out.permute(0, 2, 1, 3, 4).reshape(B, hq, d), lse2.permute(0, 2, 1, 3).reshape(B, hq)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != v.dim() or k.shape != v.shape:
        raise ValueError(f"attention: expected q [T, Hq, D] and k, v of one shape; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    hq, d = q.shape[-2], q.shape[-1]
    hkv = k.shape[-2]
    if hq % hkv != 0 or k.shape[-1] != d:
        raise ValueError(f"attention: num_q_heads ({hq}) must be a multiple of num_kv_heads "
                         f"({hkv}) and head dims must match (q {d}, k {k.shape[-1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")


def varlen_attention_reference(q, k, v, cu_seqlens, scale: float, causal: bool = True):
    """Packed variable-length attention. q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens [B+1].
    Returns (out [T, Hq, D] in q.dtype, lse2 [T, Hq] fp32)."""
    _check_shapes(q, k, v)
    out = torch.empty_like(q)
    lse2 = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    cu = [int(x) for x in cu_seqlens.tolist()]
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        if e > s:
            out[s:e], lse2[s:e] = _attend_sequence(q[s:e], k[s:e], v[s:e], scale, causal)
    return out, lse2


def gather_sequence_kv(k_cache, v_cache, block_table_row, context_len: int):
    """The first ``context_len`` keys/values of one sequence from the paged cache, in order."""
    page_size = k_cache.shape[1]
    n_pages = -(-context_len // page_size)
    pages = block_table_row[:n_pages].long()
    k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:context_len]
    v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:context_len]
    return k, v


def paged_attention_reference(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens,
                              scale: float, causal: bool = True):
    """Queries of each sequence's newest tokens over its paged KV cache (chunk already written).
    q [T, Hq, D]; k/v_cache [num_pages, page_size, Hkv, D]; block_table [B, max_pages];
    cu_seqlens_q [B+1]; context_lens [B] (keys incl. the new tokens). Returns (out, lse2).
    The sequences with one new token (decode rows) are attended side by side
    (:func:`_attend_last_rows`, each row's bits those of :func:`_attend_sequence` alone), the
    others one by one."""
    _check_shapes(q, k_cache, v_cache)
    out = torch.empty_like(q)
    lse2 = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    cu = [int(x) for x in cu_seqlens_q.tolist()]
    ctx_lens = [int(x) for x in context_lens.tolist()]
    rows, ks, vs = [], [], []    # the decode rows (one new token), attended side by side below
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        if ctx_lens[b] < e - s:
            raise ValueError(f"paged attention: sequence {b} has {e - s} new tokens but context "
                             f"length {ctx_lens[b]}; context_lens must include the new tokens")
        k, v = gather_sequence_kv(k_cache, v_cache, block_table[b], ctx_lens[b])
        if e - s == 1:
            rows.append(s)
            ks.append(k)
            vs.append(v)
        else:
            out[s:e], lse2[s:e] = _attend_sequence(q[s:e], k, v, scale, causal)
    if len(rows) == 1:
        out[rows[0]:rows[0] + 1], lse2[rows[0]:rows[0] + 1] = _attend_sequence(q[rows[0]:rows[0] + 1], ks[0], vs[0],
                                                                                scale, causal)
    elif rows:
        idx = torch.tensor(rows, device=q.device)
        o_rows, l_rows = _attend_last_rows(q[idx], ks, vs, scale, causal)
        # a NaN's payload and sign are not the same whatever path makes it (torch.maximum gives one
        # NaN in its vector body and another in its scalar tail): a row with a NaN in its output is
        # made again alone, as it was made before the rows went side by side
        nan = (torch.isnan(o_rows).flatten(1).any(1) | torch.isnan(l_rows).any(1)).tolist()
        for j, bad in enumerate(nan):
            if bad:
                r = rows[j]
                o_rows[j:j + 1], l_rows[j:j + 1] = _attend_sequence(q[r:r + 1], ks[j], vs[j], scale, causal)
        out[idx], lse2[idx] = o_rows, l_rows
    return out, lse2


def write_kv_pages_reference(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k_cache.view(-1, Hkv, D)[slot] = k[t] for every t with slot_mapping[t] >= 0 (exact copy)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[valid]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[valid]


def varlen_attention_backward_reference(q, k, v, out, lse2, dout, cu_seqlens, scale: float,
                                        causal: bool = True, q_chunk: int = 1024):
    """Gradients of packed varlen attention, fp32 torch ops, recomputing P from lse2.
    Correct at tolerance; NOT batch-invariant (the backward is not on the invariant path)."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    cu = [int(x) for x in cu_seqlens.tolist()]
    qk_scale = scale * LOG2E
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        ks = k[s:e].float().repeat_interleave(group, 1).transpose(0, 1)  # [Hq, L, D]
        vs = v[s:e].float().repeat_interleave(group, 1).transpose(0, 1)
        dks = torch.zeros_like(ks)
        dvs = torch.zeros_like(vs)
        for c0 in range(s, e, q_chunk):
            c1 = min(c0 + q_chunk, e)
            qc = q[c0:c1].float().transpose(0, 1)  # [Hq, C, D]
            doc = dout[c0:c1].float().transpose(0, 1)
            oc = out[c0:c1].float().transpose(0, 1)
            logits = torch.matmul(qc, ks.transpose(1, 2)) * qk_scale
            p = torch.exp2(logits - lse2[c0:c1].t().unsqueeze(-1))
            if causal:
                rows = torch.arange(c0 - s, c1 - s, device=q.device)
                cols = torch.arange(e - s, device=q.device)
                p = p.masked_fill(cols[None, :] > rows[:, None], 0.0)
            dp = torch.matmul(doc, vs.transpose(1, 2))
            delta = (doc * oc).sum(-1, keepdim=True)
            ds = p * (dp - delta)
            dq[c0:c1] = (torch.matmul(ds, ks) * scale).transpose(0, 1)
            dks += torch.matmul(ds.transpose(1, 2), qc) * scale
            dvs += torch.matmul(p.transpose(1, 2), doc)
        dk[s:e] = dks.transpose(0, 1).reshape(e - s, hkv, group, -1).sum(2)
        dv[s:e] = dvs.transpose(0, 1).reshape(e - s, hkv, group, -1).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def naive_attention_float64(q, k, v, cu_seqlens_q, context_lens, scale: float,
                            causal: bool = True, k_cu_seqlens=None):
    """Float64 textbook attention for correctness checks. Keys of sequence b are
    k[k_cu_seqlens[b] : k_cu_seqlens[b] + context_lens[b]] (k_cu_seqlens defaults to
    cu_seqlens_q, i.e. packed varlen self-attention); its queries are its last tokens."""
    k_cu = cu_seqlens_q if k_cu_seqlens is None else k_cu_seqlens
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(cu_seqlens_q) - 1):
        s, e = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ctx = int(context_lens[b])
        ks0 = int(k_cu[b])
        qs = q[s:e].double().transpose(0, 1)
        ks = k[ks0:ks0 + ctx].double().repeat_interleave(hq // hkv, 1).transpose(0, 1)
        vs = v[ks0:ks0 + ctx].double().repeat_interleave(hq // hkv, 1).transpose(0, 1)
        logits = torch.matmul(qs, ks.transpose(1, 2)) * scale
        if causal:
            pos = torch.arange(ctx - (e - s), ctx)
            logits = logits.masked_fill(torch.arange(ctx)[None, :] > pos[:, None], float("-inf"))
        out[s:e] = torch.matmul(torch.softmax(logits, -1), vs).transpose(0, 1)
    return out
