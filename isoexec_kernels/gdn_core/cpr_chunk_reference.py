"""Reference twin of CPR version 4 (``cpr_chunk.py``, impl ``gdn_cpr_chunk``): the same chunk form with the
same rounding points, from IEEE basic operations in a fixed order, so that on any CPU its trainer,
engine prefill split anywhere and decode agree bitwise by construction (its bits are not the GPU's).

Per chunk of C rows (a piece's last chunk padded with zero rows: g = beta = k = v = q = 0), value
head h, ``r`` = rounding to bf16 (nearest even) where the kernels round an operand or a stored value
(for values that are not fp32; with fp32 values ``r`` is the identity, as the kernels' tf32x3 dots
are fp32-accurate: ``cpr_chunk.cpr4_choice``):

    G     running sums inside each 16-row block plus the sums of the blocks before it
    A_ij  = (beta_i * (r(k_i) . r(k_j))) * exp(G_i - G_j)  for j < i, else 0
    T     = (I + A)^-1: diagonal 16-row blocks by forward substitution, the blocks below by
            T_ab = -T_aa (A_ab T_bb + A_a,b+1 T_b+1,b + ...)          (fp32)
    W     = r(r(T) @ r(k * beta e^G))       U = r(r(T) @ r(v * beta))
    Vn    = U - r(W) @ r(S)                 vn = r(Vn)
    S'    = r(k)^T @ r(Vn * e^(Gl - G)) + S * e^Gl        (S fp32, chained over the piece's chunks)
    o     = e^G * (r(q) @ r(S)) + r(M) @ vn,  M_ij = (r(q_i) . r(k_j)) exp(G_i - G_j) for j <= i

Every dot product is the halves tree of ``_ref.tree_sum0`` over its contraction (zero-padded to a
power of two), every exp is ``_ref.exp64`` rounded once. Row t of each of these depends only on
rows 0..t of its chunk (strict / inclusive masks, lower-triangular T; a later row enters only as an
exact zero term).

Decode by rows (``cpr4_decode_reference``): a token at row t of its slot's open chunk (t = fill)
gets row t of each matrix above, computed alone, from what the slot keeps (``GDNState``: the
boundary S, the open chunk's q, k, v, g, beta rows, its unrounded Vn rows and fp32 rows of T). Each
of its dot products is the prefill's dot for that row: the same contraction length (C for the
products over the chunk's rows, Dk or a 16-row block otherwise) with the same operands at the same positions
(the rows after t zero, as in the padded chunk of a prefill that ends at t), hence the same halves
tree and the same bits:

    G      as above over the chunk with rows after t zero (rows 0..t are the prefill's)
    T_t    row i = t mod 16 of block-row a = t // 16 of the blocked inverse: the diagonal block's
           substitution step i from the kept rows < i of T_aa (identity rows from i on, which is
           what the substitution holds when it reaches row i); then for each b < a,
           -(row i of T_aa) @ (A_ab T_bb + A_a,b+1 T_b+1,b + ... + A_a,a-1 T_a-1,b), the sum in the
           prefill's order over all 16 rows of block a (its rows after t made from the zero rows
           as the prefill makes them) and the kept T of the complete blocks before a
    W_t, U_t, Vn_t  from r(T_t) over the chunk's rows, Vn_t kept unrounded
    o_t    e^G_t (r(q_t) @ r(S)) + r(M_t) @ r(Vn), the rows j < t of Vn the kept ones, the rows
           after t +0 (the prefill has the zero rows' own Vn there, +-0; either way M_tj = +0 makes
           the term a zero, and a zero term changes no sum that has a nonzero one)
    S'     at t = C - 1 only, from all C unrounded Vn rows, as the prefill's state pass

The state is left as that prefill of one token leaves it: row t of every buffer, of Vn and of T
(and ``fill`` = t + 1), or, at t = C - 1, the new boundary, ``fill`` = 0 and the buffers untouched.
``_decode_prefix_reference`` is that prefill (the open chunk's rows so far recomputed every step,
about six times the row decode's time on the tiny CPU models); the tests compare the two bitwise,
outputs and every state field.
"""

from __future__ import annotations

import torch

from . import cpr_chunk, native_wy
from .plan import chunk_plan
from .cpr_row_decode import check_chunk_form_state
from .reference import _exp, _mm, _sum_dim, block_cumsum_reference, blocked_inverse_reference
from .state import CHUNK, GDNState


def _forward_reference(pq, pk, pv, pg, pb, starts, lens, init, C):
    """The chunk form over pieces, as ``cpr_chunk._forward_triton`` (same returns; q and k on the key
    heads or already repeated to the value heads)."""
    H, Dk, Dv = pv.shape[1], pk.shape[2], pv.shape[2]
    pq, pk = cpr_chunk._expand(pq, H), cpr_chunk._expand(pk, H)
    dev = pv.device
    B = len(lens)
    row0, nrow, _sidx, chunk0, nchunk, _s0, _ns = chunk_plan(starts, lens, C)
    P = len(row0)
    o = torch.zeros(pk.shape[0], H, Dv, dtype=torch.float32, device=dev)
    fin = torch.zeros(B, H, Dk, Dv, dtype=torch.float32, device=dev)
    if P == 0:
        return o, None, fin, None, None
    # the operand rounding of ``cpr_chunk.cpr4_choice``: to bf16 for values that are not fp32 (looked
    # up per call: the interpreter tests swap in truncation), none for fp32 values (tf32x3 dots)
    r = (lambda x: x) if pv.dtype == torch.float32 else native_wy.round_bf16
    t = torch.arange(C, device=dev)
    src = torch.tensor(row0, device=dev)[:, None] + t[None, :]                  # [P, C]
    ok = t[None, :] < torch.tensor(nrow, device=dev)[:, None]

    def chunks(x):   # [rows, H, ...] -> [P * H, C, ...] zero-padded, heads as lanes
        y = torch.where(ok.view(P, C, *([1] * (x.dim() - 1))), x.float()[src.clamp(max=x.shape[0] - 1)], 0.0)
        return y.movedim(2, 1).reshape(P * H, C, *x.shape[2:])

    Q, K, V, g, beta = chunks(pq), chunks(pk), chunks(pv), chunks(pg), chunks(pb)
    G = block_cumsum_reference(g)
    strict = t[None, :] < t[:, None]
    incl = t[None, :] <= t[:, None]
    zero = torch.zeros((), dtype=torch.float32, device=dev)
    # exp(G_i - G_j) for j <= i, exp(0) = 1 elsewhere: A's strict mask and M's inclusive one take the
    # same values (on the diagonal G_i - G_i is +0 either way), so one exp serves both. The exp is
    # taken on the C (C + 1) / 2 pairs j <= i only (the same subtraction G_i - G_j, elementwise), the
    # others set to exp(+0) = 1, which it is exactly: half the exps of the whole [C, C] grid
    ti, tj = torch.tril_indices(C, C, device=dev)
    eG = torch.ones(P * H, C, C, dtype=torch.float32, device=dev)
    eG[:, ti, tj] = _exp(G[:, ti] - G[:, tj])
    Kr = r(K)
    KrT = Kr.transpose(1, 2)
    Qr = r(Q)
    # A (strict lower) and M's q.k dots (inclusive lower) only where the masks can keep them: rows
    # of 16-row block a (the whole chunk when C is not a multiple of 16) against the columns
    # j < 16 (a + 1), k's rows and q's rows in one product. The dots that are made are made as
    # the whole [C, C] products made them (_mm: row-wise, each dot its own halves tree over Dk);
    # the others were masked to 0, as they are left here (62.5% of the dots at C = 64)
    BL = 16 if C % 16 == 0 else C
    A = torch.zeros(P * H, C, C, dtype=torch.float32, device=dev)
    M = torch.zeros(P * H, C, C, dtype=torch.float32, device=dev)
    okl = ok.repeat_interleave(H, 0)                                              # [P * H, C]
    mask_m = incl & okl[:, :, None]
    for a0 in range(0, C, BL):
        a1 = a0 + BL
        kq = _mm(torch.cat([Kr[:, a0:a1], Qr[:, a0:a1]], 1), KrT[:, :, :a1])     # [P * H, 2 BL, a1]
        A[:, a0:a1, :a1] = torch.where(strict[a0:a1, :a1], (beta[:, a0:a1, None] * kq[:, :BL]) * eG[:, a0:a1, :a1], zero)
        M[:, a0:a1, :a1] = torch.where(mask_m[:, a0:a1, :a1], kq[:, BL:] * eG[:, a0:a1, :a1], zero)
    T_raw = blocked_inverse_reference(A)
    Tm = r(T_raw)
    eGv = _exp(G)                                                                 # e^G [P * H, C]
    W = r(_mm(Tm, r(K * (beta * eGv)[:, :, None])))
    U = r(_mm(Tm, r(V * beta[:, :, None])))
    states = torch.empty(P, H, Dk, Dv, dtype=torch.float32, device=dev)
    vn = torch.empty(P * H, C, Dv, dtype=torch.float32, device=dev)
    vn_raw = torch.empty_like(vn)   # unrounded, as the engine keeps the open chunk's
    # the state chain, chunk after chunk inside each piece. What a chunk's step needs besides the
    # state is taken for all chunks at once: e^(G_l - G_j) (l = its last row) for its rows j <= l,
    # 0 after them, is row l of eG (the same subtraction G_l - G_j, the same exp), and e^G_l an
    # element of e^G. The pieces run side by side, step j taking the j-th chunk of every piece
    # that has one: lanes never mix in a step (row-wise dots, elementwise operations), so the
    # batching changes no bits, and a call of many short pieces takes as many steps as its
    # longest piece has chunks, not as many as all pieces have
    lane = torch.arange(P * H, device=dev)
    last = (torch.tensor(nrow, device=dev) - 1).repeat_interleave(H)
    tail = torch.where(okl, eG[lane, last], zero)[:, :, None]                     # [P * H, C, 1]
    e_last = eGv[lane, last][:, None, None]                                       # [P * H, 1, 1]
    if init is not None:
        fin.copy_(init[:B].float())
    heads = torch.arange(H, device=dev)
    for j in range(max(nchunk)):
        bs = [b for b in range(B) if nchunk[b] > j]
        cs = torch.tensor([chunk0[b] + j for b in bs], device=dev)
        lanes = (cs[:, None] * H + heads).view(-1)
        bi = torch.tensor(bs, device=dev)
        S = fin[bi]                                                               # [n, H, Dk, Dv]
        states[cs] = S
        S = S.view(-1, Dk, Dv)
        Vn = U[lanes] - _mm(W[lanes], r(S))
        vn[lanes] = r(Vn)
        vn_raw[lanes] = Vn
        Vd = Vn * tail[lanes]
        fin[bi] = (_mm(KrT[lanes], r(Vd)) + S * e_last[lanes]).view(-1, H, Dk, Dv)
    Sr = r(states).view(P * H, Dk, Dv)
    out = _mm(Qr, Sr) * eGv[:, :, None] + _mm(r(M), vn)                          # [P * H, C, Dv]
    out = out.view(P, H, C, Dv).movedim(1, 2)                                      # [P, C, H, Dv]
    o[src[ok]] = out[ok]
    return o, states, fin, vn_raw.view(P, H, C, Dv), T_raw.view(P, H, C, C)


def cpr4_varlen_reference(q, k, v, g, beta, cu_seqlens, *, chunk: int = CHUNK) -> torch.Tensor:
    """Trainer: each sequence from the zero state; o [T, H, Dv] fp32."""
    cu = cu_seqlens.tolist()
    H = v.shape[1]
    starts, lens = cu[:-1], [b - a for a, b in zip(cu[:-1], cu[1:])]
    return _forward_reference(cpr_chunk._expand(q, H), cpr_chunk._expand(k, H), v, g, beta, starts, lens,
                              None, chunk)[0]


def cpr4_engine_reference(q, k, v, g, beta, cu_seqlens_q, slots, state: GDNState, *, chunk: int = CHUNK,
                          host=None) -> torch.Tensor:
    """Engine prefill (``cpr_chunk.engine_step`` on this twin's forward; ``host``: its
    ``plan.HostPlan``)."""
    return cpr_chunk.engine_step(q, k, v, g, beta, cu_seqlens_q, slots, state, chunk, _forward_reference, host)


def _decode_prefix_reference(q, k, v, g, beta, slots, state: GDNState, *, chunk: int = CHUNK) -> torch.Tensor:
    """Engine decode by prefix: a prefill of one token per lane, the whole open chunk recomputed
    every step (the first version; kept as the row decode's yardstick, whose bits it must give)."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return cpr4_engine_reference(q, k, v, g, beta, cu, slots, state, chunk=chunk)


def cpr4_decode_reference(q, k, v, g, beta, slots, state: GDNState, *, chunk: int = CHUNK) -> torch.Tensor:
    """Engine decode, one token per lane: row t = ``fill`` of the chunk form alone (module
    docstring, "Decode by rows"), with the prefix decode's bits; updates ``state`` as that prefill of
    one token does and returns o [B, H, Dv] fp32."""
    check_chunk_form_state(state, v)
    C = chunk
    B, H, Dv = q.shape[0], v.shape[1], v.shape[2]
    Dk = state.buf_k.shape[3]
    dev = v.device
    if B == 0:
        return torch.zeros(0, H, Dv, dtype=torch.float32, device=dev)
    # the prefill's operand rounding (``_forward_reference``), looked up per call for the same reason
    r = (lambda x: x) if v.dtype == torch.float32 else native_wy.round_bf16
    N = B * H                                        # lanes (sequence b, value head h) = b * H + h
    sl = slots.to(device=dev, dtype=torch.long)
    tb = state.fill[sl].long()                       # each token's row in its open chunk
    t = tb.repeat_interleave(H)
    n = torch.arange(N, device=dev)
    rows = torch.arange(C, device=dev)
    zero = torch.zeros((), dtype=torch.float32, device=dev)

    at_t, before_t = rows == t[:, None], rows < t[:, None]                       # [N, C]

    def lanes(buf, new):
        # [S, C, H, ...] buffer and [B, H, ...] token -> [N, C, ...] in fp32: the kept rows before t,
        # the token at t, zeros after it, as the prefill's padded chunk holds them
        x = buf[sl].float().movedim(2, 1).reshape(N, C, *buf.shape[3:])
        new = new.float().reshape(N, 1, *new.shape[2:])
        shape = (N, C) + (1,) * (x.dim() - 2)
        return torch.where(before_t.view(shape), x, torch.where(at_t.view(shape), new, zero))

    Q, K = lanes(state.buf_q, cpr_chunk._expand(q, H)), lanes(state.buf_k, cpr_chunk._expand(k, H))
    V, gN, bN = lanes(state.buf_v, v), lanes(state.buf_g, g), lanes(state.buf_beta, beta)
    G = block_cumsum_reference(gN)
    Kr = r(K)
    # block-row a of the inverse (t's 16-row block, or the whole chunk when C is not a multiple of
    # 16, as ``blocked_inverse_reference`` blocks it): A's rows of that block, the rows after t made
    # from the zero rows as the prefill makes them, so that T's nesting below sums the same terms
    BL = 16 if C % 16 == 0 else C
    a, i = t // BL, t % BL
    R = a[:, None] * BL + torch.arange(BL, device=dev)                          # [N, BL] chunk rows
    GR = G.gather(1, R)
    # exp(G_m - G_j) for j <= m (1 elsewhere) on those rows, and exp(G): one exp, elementwise, taken
    # only on the pairs j <= m (the same subtraction G_m - G_j) and on G; the other pairs are
    # exp(+0) = 1, which they are exactly
    low = rows <= R[:, :, None]                                                  # [N, BL, C]
    d = (GR[:, :, None] - G[:, None, :])[low]
    ex = _exp(torch.cat([d, G.view(-1)]))
    eGR = torch.ones(N, BL, C, dtype=torch.float32, device=dev)
    eGR[low] = ex[:d.numel()]
    eG = ex[d.numel():].view(N, C)
    AR = torch.where(rows < R[:, :, None],
                     (bN.gather(1, R)[:, :, None] * _mm(Kr[n[:, None], R], Kr.transpose(1, 2))) * eGR, zero)
    Tk = state.buf_T[sl].movedim(2, 1).reshape(N, C, C)                         # kept rows of T
    # the diagonal block's substitution at its row i: the kept rows above it, identity rows from i on
    # (the rows the substitution has not reached yet)
    eye = torch.eye(BL, dtype=torch.float32, device=dev)
    blk = torch.arange(BL, device=dev)
    Ta = torch.where((blk[None, :] < i[:, None])[:, :, None], Tk[n[:, None, None], R[:, :, None], R[:, None, :]], eye)
    Ta_i = eye[i] - _sum_dim(AR[n, i].gather(1, R)[:, :, None] * Ta, 1)          # [N, BL]
    Tt = torch.zeros(N, C, dtype=torch.float32, device=dev)
    Tt.scatter_(1, R, Ta_i)
    # the blocks left of the diagonal: T_ab = -T_aa (A_ab T_bb + A_a,b+1 T_b+1,b + ... + A_a,a-1 T_a-1,b),
    # from block a's 16 rows of the sum and row i of T_aa. Every lane computes every product
    # A_ac T_cb (b <= c < nb - 1) in one batch; a lane adds those with c < a, in the prefill's order,
    # and keeps the blocks b < a (a term it does not add is selected away, not added as a zero)
    nb = C // BL
    if nb > 1:
        pairs = [(c, b) for b in range(nb - 1) for c in range(b, nb - 1)]
        Ab = AR.view(N, BL, nb, BL)
        Tb = Tk.view(N, nb, BL, nb, BL)
        terms = _mm(torch.stack([Ab[:, :, c] for c, _ in pairs], 1).view(-1, BL, BL),
                    torch.stack([Tb[:, c, :, b] for c, b in pairs], 1).view(-1, BL, BL)).view(N, len(pairs), BL, BL)
        accs = []
        for b in range(nb - 1):
            acc = terms[:, pairs.index((b, b))]
            for c in range(b + 1, nb - 1):
                acc = torch.where((c < a)[:, None, None], acc + terms[:, pairs.index((c, b))], acc)
            accs.append(acc)
        off = -_mm(Ta_i[:, None, None, :].expand(N, nb - 1, 1, BL).reshape(-1, 1, BL),
                   torch.stack(accs, 1).view(-1, BL, BL)).view(N, nb - 1, BL)
        left = torch.arange(nb - 1, device=dev)[None, :] < a[:, None]
        head = Tt[:, :(nb - 1) * BL].view(N, nb - 1, BL)
        Tt[:, :(nb - 1) * BL] = torch.where(left[:, :, None], off, head).view(N, -1)
    # row t of W and U (one product: the same dots over the chunk's C rows, zeros after t), of Vn, and
    # the output's q dots with S and with k (one product over Dk)
    Tm = r(Tt)[:, None, :]
    WU = r(_mm(Tm, torch.cat([r(K * (bN * eG)[:, :, None]), r(V * bN[:, :, None])], 2)))
    W, U = WU[:, :, :Dk], WU[:, :, Dk:]
    S = state.boundary[sl].float().reshape(N, Dk, Dv)
    Sr = r(S)
    Vn = U - _mm(W, Sr)                                                           # [N, 1, Dv]
    VN = torch.where(before_t[:, :, None], state.buf_vn[sl].movedim(2, 1).reshape(N, C, Dv),
                     torch.where(at_t[:, :, None], Vn, zero))
    Qt = r(Q[n, t])[:, None, :]
    qSK = _mm(Qt, torch.cat([Sr, Kr.transpose(1, 2)], 2))[:, 0]
    M = torch.where(rows <= t[:, None], qSK[:, Dv:] * eGR[n, i], zero)
    o = qSK[:, None, :Dv] * eG[n, t][:, None, None] + _mm(r(M)[:, None, :], r(VN))
    # the state as the prefill of one token leaves it: where the chunk completes, the boundary carried
    # across it from all C unrounded Vn rows (buffers untouched); else row t of every buffer
    done = (tb == C - 1).nonzero().flatten()
    if len(done):
        Lc = (done[:, None] * H + torch.arange(H, device=dev)).flatten()           # their lanes
        gl = G[Lc, C - 1]
        Vd = VN[Lc] * _exp(gl[:, None] - G[Lc])[:, :, None]
        Sn = _mm(Kr[Lc].transpose(1, 2), r(Vd)) + S[Lc] * _exp(gl)[:, None, None]
        state.boundary[sl[done]] = Sn.view(len(done), H, Dk, Dv)
        cpr_chunk.refresh_boundary_op(state, sl[done])   # the other slots' boundaries did not move
    open_ = (tb < C - 1).nonzero().flatten()
    if len(open_):
        s_o, t_o = sl[open_], tb[open_]
        for buf, new in ((state.buf_q, cpr_chunk._expand(q, H)), (state.buf_k, cpr_chunk._expand(k, H)),
                         (state.buf_v, v), (state.buf_g, g), (state.buf_beta, beta)):
            buf[s_o, t_o] = new[open_].float().to(buf.dtype)
        vn_o = Vn.view(B, H, Dv)[open_]
        state.buf_vn[s_o, t_o] = vn_o
        if state.buf_vn_op is not None:
            state.buf_vn_op[s_o, t_o] = vn_o.to(state.buf_vn_op.dtype)
        state.buf_T[s_o, t_o] = Tt.view(B, H, C)[open_]
    state.fill[sl] = ((tb + 1) % C).to(state.fill.dtype)
    return o.view(B, H, Dv)
