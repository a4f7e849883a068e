"""The Gated DeltaNet core by CPR: the fixed-order torch twin (IEEE basic operations only; the CPU path
of the public API). The schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import torch

from .. import _ref
from .plan import _check, _check_state, _float, _host_lens, _virtual_rows
from .state import BOUNDARY, CHUNK, GDNState


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp rounded once from float64 (position-free, see _ref.exp64)."""
    return _ref.exp64(x.double()).to(x.dtype)


def _sum_dim(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Halves-tree sum over ``dim`` (removed)."""
    return _ref.tree_sum0(t.movedim(dim, 0))


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched ``a [N, M, K] @ b [N, K, P]`` with each dot product by the halves tree over K
    (``_ref.tree_sum0``: zero-pad K to a power of two ``p``, then ``t = t[:h] + t[h:]``).

    The products are laid out K-first and contiguous, ``prod[k, n, m, p] = a[n, m, k] * b[n, k, p]``
    with zero rows for the padding, and summed in place by ``_ref.tree_sum0_``: the same products
    and the same additions on the same operands as the tree over a [n, M, K, P] product (each
    level adds row k + h to row k), but every level is one contiguous add into memory already
    allocated, where the [n, M, K, P] layout made each level a strided add into a new tensor.
    The last level writes into ``out``. Rows of N are processed in groups that keep the temporary
    near 2 MiB, so that the products and the levels of the tree stay in the caches (1.5-2x faster
    on the chunk form's [47, 64, 64, 16] and [47, 64, 16, 64] than 16 MiB groups); groups never mix
    rows, so the grouping does not change bits."""
    N, M, K = a.shape
    P = b.shape[2]
    out = a.new_empty((N, M, P))
    if K == 0:   # tree_sum0 of an empty dim: +0
        return out.zero_()
    if out.numel() == 0:
        return out
    aT = a.permute(2, 0, 1)[:, :, :, None]           # [K, N, M, 1]
    bT = b.permute(1, 0, 2)[:, :, None, :]           # [K, N, 1, P]
    if K == 1:   # a one-term tree is the product itself (no addition, -0 stays -0)
        torch.mul(aT[0], bT[0], out=out)
        return out
    p = 1 << (K - 1).bit_length()
    step = min(N, _ref.rows_per_chunk(M * p * P, 1 << 19))
    buf = a.new_empty(p * step * M * P)
    for n0 in range(0, N, step):
        n = min(step, N - n0)
        prod = buf[:p * n * M * P].view(p, n, M, P)
        torch.mul(aT[:, n0:n0 + n], bT[:, n0:n0 + n], out=prod[:K])
        if p > K:
            prod[K:].zero_()
        _ref.tree_sum0_(prod, out=out[n0:n0 + n])
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


def block_cumsum_reference(g: torch.Tensor, block: int = 16) -> torch.Tensor:
    """G [N, C] of the WY form: running sums inside each ``block``-row block plus the sums of the
    blocks before it (a chunk that is not a multiple of ``block`` rows is one block). Each block's
    running sum goes row by row from its first row, the blocks side by side (one loop over the rows
    of a block, not of the chunk: the same additions in the same order); the sum of the blocks
    before block a is chained block by block, ((s_0 + s_1) + s_2) ..., and added last.
    Returns a contiguous [N, C]."""
    N, C = g.shape
    if C % block:
        block = C
    nb = C // block
    # the rows of the blocks K-first (run[p] = row p of every block of every lane), the running
    # sums written in place: the additions of acc = ((+0 + g_0) + g_1) + ... with fewer torch calls
    gT = g.reshape(N, nb, block).permute(2, 0, 1)                                # [p, N, nb]
    run = g.new_empty((block, N, nb))
    torch.add(g.new_zeros(()), gT[0], out=run[0])
    for p in range(1, block):
        torch.add(run[p - 1], gT[p], out=run[p])
    if nb > 1:
        acc = run[block - 1].clone()                                              # the block sums
        before = acc[:, 0]
        for a in range(1, nb):
            run[:, :, a].add_(before)
            before = before + acc[:, a]
    return run.permute(1, 2, 0).contiguous().view(N, C)


def blocked_inverse_reference(A: torch.Tensor, block: int = 16) -> torch.Tensor:
    """(I + A)^-1 for strictly lower triangular A [N, C, C]: each diagonal ``block``-row block by
    forward substitution, the blocks below it by T_ab = -T_aa (sum_{c=b}^{a-1} A_ac T_cb), the sum
    from the innermost dot A_ab T_bb on, as the kernel nests its dots (A's dtype, fixed order).

    Independent blocks are computed side by side (lanes of one batch never mix: the dots are
    row-wise, so the batching changes no bits): the diagonal blocks' substitutions all at once,
    row i of each from ``eye[i] - (row i of A_aa) @ T_aa`` (the halves-tree dot over the block's
    rows, laid out K-first and summed in place as in ``_mm``, without its per-call set-up); then
    the blocks below the diagonal by their distance d = a - b from it, since T_ab needs only the
    T_cb with b <= c < a, which are nearer: at each distance one ``_mm`` makes every term
    A_ac T_cb of every block, the terms are added in the order c = b, b + 1, ..., and one more
    ``_mm`` multiplies by T_aa. Returns a contiguous [N, C, C]."""
    N, C, _ = A.shape
    if C % block:
        block = C
    nb = C // block
    eye = torch.eye(block, dtype=A.dtype, device=A.device)
    Ab = A.reshape(N, nb, block, nb, block).permute(1, 3, 0, 2, 4)               # [a, c, N, i, j]
    diag = torch.arange(nb, device=A.device)
    # the substitution K-first: TaT[j] is row j of every lane's T_aa (identity rows until reached),
    # AdT[i, j] the lanes' A_aa[i, j]; prod[j] = A_aa[i, j] * T_aa[j, :] summed over j in place by
    # the halves tree (zero rows pad j to a power of two: only read, never written, so zeroed once)
    L = nb * N
    AdT = Ab[diag, diag].permute(2, 3, 0, 1).reshape(block, block, L)             # [i, j, lanes]
    TaT = eye[:, None, :].repeat(1, L, 1)                                         # [j, lanes, q]
    p = 1 << (block - 1).bit_length()
    prod = A.new_empty((p, L, block))
    prod[block:].zero_()
    for i in range(1, block):
        torch.mul(AdT[i][:, :, None], TaT, out=prod[:block])
        torch.sub(eye[i], _ref.tree_sum0_(prod), out=TaT[i])
    Tm = A.new_zeros(A.shape)                                                     # contiguous
    Tb = Tm.view(N, nb, block, nb, block).permute(1, 3, 0, 2, 4)                  # a view of Tm
    Ta = TaT.permute(1, 0, 2).reshape(nb, N, block, block)
    Tb[diag, diag] = Ta
    for d in range(1, nb):
        b = torch.arange(nb - d, device=A.device)                                 # blocks (b + d, b)
        j = torch.arange(d, device=A.device)[:, None]                              # term c = b + j
        terms = _mm(Ab[b + d, b + j].reshape(-1, block, block),
                    Tb[b + j, b].reshape(-1, block, block)).view(d, nb - d, N, block, block)
        acc = terms[0]
        for t in range(1, d):
            acc = acc + terms[t]
        Tb[b + d, b] = -_mm(Ta[b + d].reshape(-1, block, block), acc.reshape(-1, block, block)).view(
            nb - d, N, block, block)
    return Tm


def _chunk_prep_wy_reference(K, V, g, beta, block: int = 16):
    """The state-independent part of chunk_update in the WY form (``boundary = "wy"``, cpr_wy.py)
    for N complete chunks (blocks of 16 rows; a chunk that is not a multiple of 16 is one block):
    G by running sums inside the blocks plus the blocks before them; A;
    T = (I + A)^-1 with each diagonal block by forward substitution and the blocks below by
    T_ab = -T_aa (sum_{c=b}^{a-1} A_ac T_cb) (the sum from c = a - 1 down, as the kernel nests its
    dots); W = T (k beta e^G), U = T (v beta). Returns (W, U, K, e_last, tail = e^(G_last - G)),
    so that B_c+1 = B_c e_last + K^T ((U - W B_c) tail)."""
    N, C = g.shape
    G = block_cumsum_reference(g, block)
    idx = torch.arange(C, device=g.device)
    lower = idx[None, :] < idx[:, None]
    zero = torch.zeros((), dtype=g.dtype, device=g.device)
    dG = torch.where(lower, G[:, :, None] - G[:, None, :], zero)
    A = torch.where(lower, (beta[:, :, None] * _mm(K, K.transpose(1, 2))) * _exp(dG), zero)
    Tm = blocked_inverse_reference(A, block)
    W = _mm(Tm, K * (beta * _exp(G))[:, :, None])
    U = _mm(Tm, V * beta[:, :, None])
    g_last = G[:, C - 1]
    return W, U, K, _exp(g_last), _exp(g_last[:, None] - G)


def _chunk_state_wy_reference(S, W, U, K, e_last, tail):
    """B_{c+1} from B_c = S [N, Dk, Dv] and the WY prep of the chunk."""
    Vn = (U - _mm(W, S)) * tail[:, :, None]
    return S * e_last[:, None, None] + _mm(K.transpose(1, 2), Vn)


def _boundary_prep(K, V, g, beta):
    return _chunk_prep_wy_reference(K, V, g, beta) if BOUNDARY == "wy" else _chunk_prep_reference(K, V, g, beta)


def _boundary_step(S, *prep):
    return _chunk_state_wy_reference(S, *prep) if BOUNDARY == "wy" else _chunk_state_reference(S, *prep)


def chunk_update_reference(S, K, V, g, beta):
    """``chunk_update`` of api.py's docstring for N lanes (in the pinned form, ``BOUNDARY``):
    S [N, Dk, Dv], K [N, C, Dk], V [N, C, Dv], g, beta [N, C] -> S' [N, Dk, Dv]."""
    return _boundary_step(S, *_boundary_prep(K, V, g, beta))


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
        prep = _boundary_prep(
            kp[:, :, :max_full].reshape(-1, C, Dk), vp[:, :, :max_full].reshape(-1, C, Dv),
            gp[:, :, :max_full].reshape(-1, C), bp[:, :, :max_full].reshape(-1, C))
        prep = [x.view(B, H, max_full, *x.shape[1:]) for x in prep]
        for c in range(max_full):
            S_next = _boundary_step(S.reshape(-1, Dk, Dv), *(x[:, :, c].reshape(-1, *x.shape[3:])
                                                            for x in prep)).view(B, H, Dk, Dv)
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
