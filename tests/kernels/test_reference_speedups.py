"""The CPU reference twins after their speedups give the bits of their earlier formulations.

Each speedup in the references (``isoexec_kernels/gdn_core``, ``_ref.py``) is an exact
reformulation: the same IEEE operations on the same operands in the same order, laid out or
batched differently. Each test here keeps the earlier formulation as a small private helper (or
spells the computation out) and compares the two bitwise through integer views (int32 for fp32,
int64 for fp64) on random shapes, non-powers of two, K = 1, empty dims, signed zeros, infinities
and NaN. Both sides run on the same machine: nothing here depends on stored bit patterns.
"""

from __future__ import annotations

import pytest
import torch

from isoexec_kernels import _ref
from isoexec_kernels.gdn_core import reference as R

INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT_VIEW[t.dtype])


def assert_same_bits(new: torch.Tensor, old: torch.Tensor, what: str) -> None:
    assert new.shape == old.shape and new.dtype == old.dtype, (what, new.shape, old.shape, new.dtype, old.dtype)
    diff = bits(new) != bits(old)
    assert not bool(diff.any()), f"{what}: {int(diff.sum())} of {diff.numel()} elements differ"


def nan_with_payload(dtype, payload: int, negative: bool = False) -> torch.Tensor:
    """A quiet NaN with its own payload and sign: where two NaNs meet, the result's bits say which
    operand it came from."""
    if dtype == torch.float32:
        v = 0x7FC00000 | payload | (0x80000000 if negative else 0)
        return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v], dtype=torch.int32).view(dtype)[0]
    v = 0x7FF8000000000000 | payload | (0x8000000000000000 if negative else 0)
    return torch.tensor([v - (1 << 64) if v >= 1 << 63 else v], dtype=torch.int64).view(dtype)[0]


def specials(shape, dtype, gen, frac: float = 0.08) -> torch.Tensor:
    """Random normals with a fraction of +0, -0, +inf, -inf and NaNs (the default one and two with
    other payloads and signs), and whole rows of -0 (so that some dot products are sums of -0 terms
    only, whose sign the padding and the tree decide)."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    if x.numel() == 0:
        return x
    pick = torch.rand(shape, generator=gen, dtype=torch.float64)
    vals = [torch.tensor(v, dtype=dtype) for v in (0.0, -0.0, float("inf"), -float("inf"), float("nan"))]
    vals += [nan_with_payload(dtype, 0x123), nan_with_payload(dtype, 0x456, negative=True)]
    for j, v in enumerate(vals):
        lo = j * frac / len(vals)
        x = torch.where((pick >= lo) & (pick < lo + frac / len(vals)), v, x)
    if x.dim() >= 2 and x.shape[-2] > 1:
        x[..., 0, :] = -0.0
    return x


# ---------------------------------------------------------------------------------------------
# gdn_core.reference._mm
# ---------------------------------------------------------------------------------------------

def _mm_nmkp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``_mm`` before it went K-first: the [n, M, K, P] product summed over K by ``_ref.tree_sum0``
    (zero-pad K to a power of two, ``t = t[:h] + t[h:]``), 2^22-element row groups."""
    N, M, K = a.shape
    P = b.shape[2]
    out = a.new_empty((N, M, P))
    step = _ref.rows_per_chunk(M * K * P, 1 << 22)
    for n0 in range(0, N, step):
        prod = a[n0:n0 + step, :, :, None] * b[n0:n0 + step, None, :, :]
        out[n0:n0 + step] = _ref.tree_sum0(prod.movedim(2, 0))
    return out


MM_SHAPES = [  # N, M, K, P
    (3, 4, 1, 5), (2, 3, 2, 4), (3, 5, 3, 2), (4, 2, 5, 3), (2, 7, 12, 6), (3, 4, 16, 4), (2, 3, 17, 5),
    (2, 5, 33, 3), (4, 64, 16, 64), (3, 64, 64, 16), (5, 1, 64, 32), (6, 16, 16, 16), (1, 1, 1, 1),
    (70, 64, 64, 16),   # several row groups, the last one partial
    (0, 3, 4, 5), (3, 0, 4, 5), (3, 4, 0, 5), (3, 4, 5, 0), (0, 0, 0, 0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mm_k_first_layout_gives_the_halves_tree_bits(dtype):
    gen = torch.Generator().manual_seed(7)
    for N, M, K, P in MM_SHAPES:
        a = specials((N, M, K), dtype, gen)
        b = specials((N, K, P), dtype, gen)
        assert_same_bits(R._mm(a, b), _mm_nmkp(a, b), f"_mm {N, M, K, P} {dtype}")


def test_mm_takes_strided_operands():
    """The chunk form passes transposes and slices (``Kr.transpose(1, 2)``, ``blk(A, a, c)``)."""
    gen = torch.Generator().manual_seed(8)
    a = specials((5, 24, 40), torch.float32, gen)[:, 3:20, 5:30]          # [5, 17, 25], strided
    b = specials((5, 30, 25), torch.float32, gen).transpose(1, 2)[:, :, 2:9]  # [5, 25, 7]
    assert_same_bits(R._mm(a, b), _mm_nmkp(a, b), "_mm strided")


def test_mm_keeps_the_sign_of_zero_sums():
    """-0 terms only: the sum is -0 for a power-of-two K (and K = 1), +0 where the padding's +0
    rows enter; the old and new layouts agree on every one."""
    for K in (1, 2, 3, 4, 5, 8, 13):
        a = torch.full((2, 3, K), -0.0)
        b = torch.ones(2, K, 4)
        got = R._mm(a, b)
        assert_same_bits(got, _mm_nmkp(a, b), f"-0 sums, K={K}")
        want_neg = K & (K - 1) == 0
        assert bool(torch.signbit(got).all()) == want_neg, (K, got)


# ---------------------------------------------------------------------------------------------
# _ref.exp64
# ---------------------------------------------------------------------------------------------

def _exp64_div_pow2(x: torch.Tensor) -> torch.Tensor:
    """``_ref.exp64`` before its speedup: Horner from a filled tensor, n1 = floor(n / 2) by a float
    floor division, each power of two from the float exponent."""
    def pow2(n):
        return ((n.to(torch.int64) + 1023) << 52).view(torch.float64)

    xc = x.clamp(-800.0, 800.0)
    n = torch.round(xc * _ref._INV_LN2)
    r = (xc - n * _ref._LN2_HI).sub_(n * _ref._LN2_LO)
    p = torch.full_like(r, _ref._EXP_COEF[-1])
    for c in reversed(_ref._EXP_COEF[:-1]):
        p.mul_(r).add_(c)
    n1 = torch.div(n, 2, rounding_mode="floor")
    out = p.mul_(pow2(n1)).mul_(pow2(n - n1))
    return torch.where(torch.isnan(x), x, out)


def test_exp64_shift_exponents_give_the_floor_division_bits():
    gen = torch.Generator().manual_seed(11)
    edges = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 800.0, -800.0, 801.0, -801.0,
                          709.782712893384, 709.7827128933841, -708.39641853226408, -708.3964185322642,
                          -744.4400719213812, -745.1332191019411, -745.1332191019412, -746.0, 1e-300, -1e-300,
                          5e-324, -5e-324, 0.5 * 0.6931471805599453, -0.5 * 0.6931471805599453, 1e308, -1e308])
    wide = torch.empty(200_000, dtype=torch.float64).uniform_(-820.0, 820.0, generator=gen)
    small = torch.randn(100_000, generator=gen, dtype=torch.float64)
    # every rounding boundary of n = round(x / ln 2) in the range, and its neighbours
    k = torch.arange(-1160, 1161, dtype=torch.float64) + 0.5
    half = k * 0.6931471805599453
    near = torch.cat([half, torch.nextafter(half, half + 1), torch.nextafter(half, half - 1)])
    nans = torch.stack([nan_with_payload(torch.float64, 0x123), nan_with_payload(torch.float64, 0x456, True)])
    x = torch.cat([edges, nans, wide, small, near, -near])
    assert_same_bits(_ref.exp64(x), _exp64_div_pow2(x), "exp64")
    xs = x[:300_000].view(3, -1)[:, ::2]
    assert_same_bits(_ref.exp64(xs), _exp64_div_pow2(xs), "exp64 strided")
    assert _ref.exp64(torch.zeros(0, dtype=torch.float64)).shape == (0,)
    assert_same_bits(_ref.exp64(torch.tensor([0.0, -0.0], dtype=torch.float64)), torch.ones(2, dtype=torch.float64),
                     "exp64(+-0) = 1 exactly")


# ---------------------------------------------------------------------------------------------
# gdn_core.reference.blocked_inverse_reference
# ---------------------------------------------------------------------------------------------

def _blocked_inverse_block_by_block(A: torch.Tensor, block: int = 16, mm=_mm_nmkp) -> torch.Tensor:
    """``blocked_inverse_reference`` before it batched its blocks: one diagonal block after the
    other, row i of it from ``eye[i] - tree_sum0 over j of A_aa[i, j] * T_aa[j, :]``, then the blocks
    left of it, b = a - 1 down to 0, each sum from c = b up."""
    N, C, _ = A.shape
    if C % block:
        block = C
    eye = torch.eye(block, dtype=A.dtype, device=A.device)
    blk = lambda x, a, b: x[:, a * block:(a + 1) * block, b * block:(b + 1) * block]  # noqa: E731
    Tm = torch.zeros_like(A)
    for a in range(C // block):
        Ta = eye.expand(N, block, block).clone()
        Aa = blk(A, a, a)
        for i in range(1, block):
            Ta[:, i] = eye[i] - _ref.tree_sum0((Aa[:, i, :, None] * Ta).movedim(1, 0))
        blk(Tm, a, a).copy_(Ta)
        for b in range(a - 1, -1, -1):
            acc = None
            for c in range(b, a):
                term = mm(blk(A, a, c), blk(Tm, c, b))
                acc = term if acc is None else acc + term
            blk(Tm, a, b).copy_(-mm(Ta, acc))
    return Tm


@pytest.mark.parametrize("C,block", [(64, 16), (48, 16), (32, 16), (16, 16), (40, 16), (24, 8), (5, 16), (64, 32)])
def test_blocked_inverse_batched_blocks_give_the_block_by_block_bits(C, block):
    gen = torch.Generator().manual_seed(C * 100 + block)
    for dtype in (torch.float32, torch.float64):
        for N in (0, 1, 5):
            A = (torch.randn(N, C, C, generator=gen, dtype=torch.float64) * 0.3).to(dtype).tril(-1)
            if N:
                A[0] = specials((C, C), dtype, gen, frac=0.02).tril(-1)   # inf / NaN spread through T
                A[-1, :, 0] = -0.0
            got = R.blocked_inverse_reference(A, block)
            assert_same_bits(got, _blocked_inverse_block_by_block(A, block), f"inverse C={C} block={block} N={N}")
            As = torch.zeros(N, C + 3, C + 3, dtype=dtype)
            As[:, 1:C + 1, 2:C + 2] = A
            As = As[:, 1:C + 1, 2:C + 2]                                  # a strided view of A
            assert_same_bits(R.blocked_inverse_reference(As, block), got, f"inverse of a view, C={C}")
    # and it is an inverse (a guard on the reference itself, not only on the reformulation)
    A = (torch.randn(3, C, C, generator=gen, dtype=torch.float64) * 0.1).tril(-1)
    eye = torch.eye(C, dtype=torch.float64)
    assert torch.allclose(R.blocked_inverse_reference(A, block) @ (eye + A), eye.expand(3, C, C), atol=1e-12)


# ---------------------------------------------------------------------------------------------
# gdn_core.cpr_chunk_reference._forward_reference (and through it _mm, exp64, the inverse)
# ---------------------------------------------------------------------------------------------

def _exp_div_pow2(x: torch.Tensor) -> torch.Tensor:
    return _exp64_div_pow2(x.double()).to(x.dtype)


def _forward_piece_by_piece(pq, pk, pv, pg, pb, starts, lens, init, C):
    """``_forward_reference`` before its speedups, with the earlier ``_mm``, exp64 and inverse
    above: exp over the whole [C, C] grid, the state chain one piece after the other, each chunk's
    tail decay and e^G_last made inside the chain."""
    from isoexec_kernels.gdn_core import cpr_chunk, native_wy
    from isoexec_kernels.gdn_core.plan import chunk_plan

    _mm, _exp = _mm_nmkp, _exp_div_pow2
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
    r = (lambda x: x) if pv.dtype == torch.float32 else native_wy.round_bf16
    t = torch.arange(C, device=dev)
    src = torch.tensor(row0, device=dev)[:, None] + t[None, :]
    ok = t[None, :] < torch.tensor(nrow, device=dev)[:, None]

    def chunks(x):
        y = torch.where(ok.view(P, C, *([1] * (x.dim() - 1))), x.float()[src.clamp(max=x.shape[0] - 1)], 0.0)
        return y.movedim(2, 1).reshape(P * H, C, *x.shape[2:])

    Q, K, V, g, beta = chunks(pq), chunks(pk), chunks(pv), chunks(pg), chunks(pb)
    G = R.block_cumsum_reference(g)
    strict = t[None, :] < t[:, None]
    incl = t[None, :] <= t[:, None]
    zero = torch.zeros((), dtype=torch.float32, device=dev)
    dG = G[:, :, None] - G[:, None, :]
    eG = _exp(torch.where(incl, dG, zero))
    Kr = r(K)
    A = torch.where(strict, (beta[:, :, None] * _mm(Kr, Kr.transpose(1, 2))) * eG, zero)
    T_raw = _blocked_inverse_block_by_block(A)
    Tm = r(T_raw)
    W = r(_mm(Tm, r(K * (beta * _exp(G))[:, :, None])))
    U = r(_mm(Tm, r(V * beta[:, :, None])))
    states = torch.empty(P, H, Dk, Dv, dtype=torch.float32, device=dev)
    vn = torch.empty(P * H, C, Dv, dtype=torch.float32, device=dev)
    vn_raw = torch.empty_like(vn)
    okl = ok.repeat_interleave(H, 0)
    for b in range(B):
        S = (init[b].float() if init is not None else torch.zeros(H, Dk, Dv, device=dev))
        for c in range(chunk0[b], chunk0[b] + nchunk[b]):
            lanes = slice(c * H, (c + 1) * H)
            states[c] = S
            Vn = U[lanes] - _mm(W[lanes], r(S))
            vn[lanes] = r(Vn)
            vn_raw[lanes] = Vn
            gl = G[lanes, nrow[c] - 1]
            Vd = Vn * torch.where(okl[lanes], _exp(gl[:, None] - G[lanes]), zero)[:, :, None]
            S = _mm(Kr[lanes].transpose(1, 2), r(Vd)) + S * _exp(gl)[:, None, None]
        fin[b] = S
    Sr = r(states).view(P * H, Dk, Dv)
    M = torch.where(incl & okl[:, :, None], _mm(r(Q), Kr.transpose(1, 2)) * eG, zero)
    out = _mm(r(Q), Sr) * _exp(G)[:, :, None] + _mm(r(M), vn)
    out = out.view(P, H, C, Dv).movedim(1, 2)
    o[src[ok]] = out[ok]
    return o, states, fin, vn_raw.view(P, H, C, Dv), T_raw.view(P, H, C, C)


def _pieces(lens, Hk, H, Dk, Dv, v_dtype, seed):
    from gdn_inputs import make_inputs

    q, k, v, g, beta, cu = make_inputs(lens, Hk, H, Dk, Dv, seed, v_dtype=v_dtype)
    starts = cu[:-1].tolist()
    return q, k, v, g, beta, starts, list(lens)


FORWARD_CASES = [  # lens, C, with init
    ([70], 64, False), ([1, 64, 0, 130, 17, 63, 65], 64, True), ([5, 200, 3, 3, 40], 64, False),
    ([33, 16, 1, 50], 16, True), ([100, 7, 49], 48, True), ([90, 2, 41], 40, False), ([0, 0], 64, True),
    ([12, 3, 25], 5, True),
]


@pytest.mark.parametrize("case", range(len(FORWARD_CASES)))
@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16])
def test_chunk_form_forward_batched_state_chain_gives_the_piece_by_piece_bits(case, v_dtype):
    from isoexec_kernels.gdn_core import cpr_chunk_reference as CR

    lens, C, with_init = FORWARD_CASES[case]
    Hk, H, Dk, Dv = 2, 4, 16, 8
    q, k, v, g, beta, starts, lens = _pieces(lens, Hk, H, Dk, Dv, v_dtype, seed=case)
    gen = torch.Generator().manual_seed(100 + case)
    T = v.shape[0]
    if T > 10:   # a NaN value, -0 keys, a decay that underflows e^G, a huge beta: every piece sees some
        v[3, 1, 2] = float("nan")
        k[5:9, 0] = -0.0
        g[T // 2, 2] = -300.0
        beta[T - 1, 3] = 1e30
    init = torch.randn(len(lens), H, Dk, Dv, generator=gen) if with_init else None
    new = CR._forward_reference(q, k, v, g, beta, starts, lens, init, C)
    old = _forward_piece_by_piece(q, k, v, g, beta, starts, lens, init, C)
    names = ("o", "states", "fin", "vn_raw", "T_raw")
    for name, a, b in zip(names, new, old):
        if b is None:
            assert a is None, name
        else:
            assert_same_bits(a, b, f"forward {name} lens={lens} C={C} {v_dtype}")


# ---------------------------------------------------------------------------------------------
# gdn_core.reference.block_cumsum_reference
# ---------------------------------------------------------------------------------------------

def _block_cumsum_row_loop(g: torch.Tensor, block: int = 16) -> torch.Tensor:
    """``block_cumsum_reference`` before it went K-first: acc = acc + g[:, :, p] from +0, stored
    row by row, then the sums of the blocks before each block chained and added."""
    N, C = g.shape
    if C % block:
        block = C
    nb = C // block
    gb = g.reshape(N, nb, block)
    run = torch.empty_like(gb)
    acc = g.new_zeros(N, nb)
    for p in range(block):
        acc = acc + gb[:, :, p]
        run[:, :, p] = acc
    G = run.clone()
    before = acc[:, 0]
    for a in range(1, nb):
        G[:, a] = run[:, a] + before[:, None]
        before = before + acc[:, a]
    return G.view(N, C)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_block_cumsum_k_first_gives_the_row_loop_bits(dtype):
    gen = torch.Generator().manual_seed(5)
    for C in (64, 48, 40, 32, 16, 5, 1):
        for N in (0, 1, 7):
            g = specials((N, C), dtype, gen, frac=0.1) * 3
            if N and C:
                g[-1] = -0.0          # -0 rows: +0 + -0 starts every running sum at +0
            got = R.block_cumsum_reference(g)
            assert got.is_contiguous()
            assert_same_bits(got, _block_cumsum_row_loop(g), f"block_cumsum C={C} N={N} {dtype}")


# ---------------------------------------------------------------------------------------------
# gdn_core.cpr_chunk_reference.cpr4_decode_reference
# ---------------------------------------------------------------------------------------------

def _decode_rows_before(q, k, v, g, beta, slots, state, *, chunk):
    """``cpr4_decode_reference`` before its speedups (with the earlier _mm, exp64 and block cumsum
    above): masks made per buffer, exp on the whole [BL, C] block of pairs."""
    from isoexec_kernels.gdn_core import cpr_chunk, native_wy
    from isoexec_kernels.gdn_core.cpr_row_decode import check_chunk_form_state

    _mm, _exp, block_cumsum_reference = _mm_nmkp, _exp_div_pow2, _block_cumsum_row_loop
    _sum_dim = lambda t, dim: _ref.tree_sum0(t.movedim(dim, 0))  # noqa: E731
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

    def lanes(buf, new):
        # [S, C, H, ...] buffer and [B, H, ...] token -> [N, C, ...] in fp32: the kept rows before t,
        # the token at t, zeros after it, as the prefill's padded chunk holds them
        x = buf[sl].float().movedim(2, 1).reshape(N, C, *buf.shape[3:])
        new = new.float().reshape(N, 1, *new.shape[2:])
        shape = (N, C) + (1,) * (x.dim() - 2)
        at, before = (rows == t[:, None]).view(shape), (rows < t[:, None]).view(shape)
        return torch.where(before, x, torch.where(at, new, zero))

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
    # exp(G_m - G_j) for j <= m (1 elsewhere) on those rows, and exp(G): one exp, elementwise
    ex = _exp(torch.cat([torch.where(rows <= R[:, :, None], GR[:, :, None] - G[:, None, :], zero).view(N, -1), G], 1))
    eGR, eG = ex[:, :BL * C].view(N, BL, C), ex[:, BL * C:]
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
    VN = torch.where((rows < t[:, None])[:, :, None], state.buf_vn[sl].movedim(2, 1).reshape(N, C, Dv),
                     torch.where((rows == t[:, None])[:, :, None], Vn, zero))
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


def _state_copy(st):
    import dataclasses

    return type(st)(**{f.name: (None if getattr(st, f.name) is None else getattr(st, f.name).clone())
                       for f in dataclasses.fields(st)})


@pytest.mark.parametrize("C", [64, 48, 40, 16])
@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16])
def test_row_decode_gives_the_bits_it_gave_before_its_speedups(C, v_dtype):
    """Slots at different rows of their open chunks (0, inside a block, a block's last row, the
    chunk's last row: the boundary update) decode side by side; every output and every state
    field is compared after each step."""
    from isoexec_kernels.gdn_core import GDNState
    from isoexec_kernels.gdn_core import cpr_chunk_reference as CR
    from gdn_inputs import make_inputs

    Hk, H, Dk, Dv = 2, 4, 16, 8
    prompt = [C - 3, 1, 15, 0, 2 * C - 1, 17]
    steps = 5
    B = len(prompt)
    q, k, v, g, beta, cu = make_inputs(prompt, Hk, H, Dk, Dv, seed=C, v_dtype=v_dtype)
    st = GDNState.allocate(B + 1, H, Dk, Dv, "cpu", chunk=C, with_q=True, value_dtype=v_dtype)
    slots = torch.arange(1, B + 1)
    nz = [b for b, n in enumerate(prompt) if n]
    cu_nz = torch.tensor([0] + torch.tensor([prompt[b] for b in nz]).cumsum(0).tolist(), dtype=torch.int32)
    CR.cpr4_engine_reference(q, k, v, g, beta, cu_nz, slots[nz], st, chunk=C)
    dq, dk, dv, dg, db, _ = make_inputs([B] * steps, Hk, H, Dk, Dv, seed=C + 1, v_dtype=v_dtype)
    dv = dv.clone()
    dv[B + 2, 1, 3] = float("nan")     # one lane's value NaN from step 1 on
    dk = dk.clone()
    dk[2 * B + 4, 0] = -0.0
    for s in range(steps):
        rows = slice(s * B, (s + 1) * B)
        a, b_ = _state_copy(st), _state_copy(st)
        args = (dq[rows], dk[rows], dv[rows], dg[rows], db[rows], slots)
        o_new = CR.cpr4_decode_reference(*args, a, chunk=C)
        o_old = _decode_rows_before(*args, b_, chunk=C)
        assert_same_bits(o_new, o_old, f"decode output C={C} step {s}")
        import dataclasses
        for f in dataclasses.fields(a):
            x, y = getattr(a, f.name), getattr(b_, f.name)
            if x is None:
                assert y is None
            elif x.is_floating_point() and x.dtype in INT_VIEW:
                assert_same_bits(x, y, f"state.{f.name} C={C} step {s}")
            else:
                assert torch.equal(x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
                                   y.view(torch.int16) if y.dtype == torch.bfloat16 else y), f.name
        st = a
    assert int(st.fill[2]) == 1 + steps and int(st.fill[1]) == (C - 3 + steps) % C   # slot 1 completed its chunk


# ---------------------------------------------------------------------------------------------
# attention.reference: exp2_fixed, paged_attention_reference's decode rows side by side
# ---------------------------------------------------------------------------------------------

def _exp2_fixed_before(x: torch.Tensor) -> torch.Tensor:
    """``exp2_fixed`` before its speedup: Horner from a filled tensor, out of place."""
    from isoexec_kernels.attention.reference import _EXP2_COEFFS

    x = x.float().clamp(min=-200.0, max=127.0)
    n = torch.round(x)
    f = x - n
    poly = torch.full_like(f, _EXP2_COEFFS[0])
    for c in _EXP2_COEFFS[1:]:
        poly = poly * f
        poly = poly + c
    n_int = n.to(torch.int32)
    scale = ((n_int.clamp(min=-126) + 127) << 23).view(torch.float32)
    out = poly * scale
    return torch.where(n_int < -126, torch.zeros_like(out), out)


def test_exp2_fixed_in_place_horner_gives_the_out_of_place_bits():
    from isoexec_kernels.attention.reference import exp2_fixed

    gen = torch.Generator().manual_seed(13)
    edges = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -126.0, -126.5, -125.5, -127.0,
                          -149.0, -200.0, -201.0, 127.0, 127.5, 128.0, 0.5, -0.5, 1e-45, -1e-45, 3e38, -3e38])
    wide = torch.empty(300_000).uniform_(-210.0, 135.0, generator=gen)
    halves = torch.arange(-205, 131, dtype=torch.float32) + 0.5
    near = torch.cat([halves, torch.nextafter(halves, halves + 1), torch.nextafter(halves, halves - 1)])
    nans = torch.stack([nan_with_payload(torch.float32, 0x123), nan_with_payload(torch.float32, 0x456, True)])
    x = torch.cat([edges, nans, wide, torch.randn(50_000, generator=gen), near])
    assert_same_bits(exp2_fixed(x), _exp2_fixed_before(x), "exp2_fixed")
    assert_same_bits(exp2_fixed(x.bfloat16()), _exp2_fixed_before(x.bfloat16()), "exp2_fixed of bf16")
    xs = x[:300_000].view(3, -1)[:, ::3]
    assert_same_bits(exp2_fixed(xs), _exp2_fixed_before(xs), "exp2_fixed strided")


def _attend_sequence_before(q, k, v, scale: float, causal: bool):
    """``attention.reference._attend_sequence`` before its speedups (two exp2 calls per block,
    the earlier exp2_fixed); the paged reference ran it sequence by sequence."""
    from isoexec_kernels.attention.reference import BLOCK_N as block_n, LOG2E, tree_sum

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
        alpha = _exp2_fixed_before(m_old - m_new)
        p = _exp2_fixed_before(s - m_new.unsqueeze(-1))
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


def _paged_before(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens, scale, causal=True):
    """``paged_attention_reference`` before it batched its decode rows: sequence by sequence."""
    from isoexec_kernels.attention.reference import gather_sequence_kv

    out = torch.empty_like(q)
    lse2 = torch.empty(q.shape[:2], dtype=torch.float32)
    cu = cu_seqlens_q.tolist()
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        if e > s:
            k, v = gather_sequence_kv(k_cache, v_cache, block_table[b], int(context_lens[b]))
            out[s:e], lse2[s:e] = _attend_sequence_before(q[s:e], k, v, scale, causal)
    return out, lse2


PAGED_CASES = [  # new tokens per sequence, context length per sequence (0 new: skipped)
    ([1, 1, 1, 1, 1, 1], [1, 63, 64, 65, 130, 200]),      # decode rows only, 1..4 blocks
    ([1, 5, 1, 0, 1, 3], [70, 5, 1, 9, 129, 64]),          # decode rows among prefill chunks
    ([1], [100]), ([1, 1], [64, 64]), ([0, 0], [3, 4]), ([], []),
]


@pytest.mark.parametrize("case", range(len(PAGED_CASES)))
@pytest.mark.parametrize("dtype,d,causal", [(torch.float32, 16, True), (torch.bfloat16, 16, True),
                                            (torch.float16, 12, True), (torch.bfloat16, 12, False)])
def test_paged_attention_decode_rows_side_by_side_give_the_sequence_by_sequence_bits(case, dtype, d, causal):
    from isoexec_kernels.attention.reference import paged_attention_reference

    new, ctx = PAGED_CASES[case]
    gen = torch.Generator().manual_seed(case * 10 + d)
    hq, hkv, page = 4, 2, 16
    pages_per_seq = [-(-c // page) for c in ctx]
    num_pages = sum(pages_per_seq) + 3
    kc = (torch.randn(num_pages, page, hkv, d, generator=gen)).to(dtype)
    vc = (torch.randn(num_pages, page, hkv, d, generator=gen)).to(dtype)
    perm = torch.randperm(num_pages, generator=gen)       # pages scattered in the cache
    bt = torch.zeros(len(ctx), max(pages_per_seq + [1]), dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_seq):
        bt[b, :n] = perm[used:used + n]
        used += n
    cu = torch.tensor([0] + torch.tensor(new, dtype=torch.long).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=gen).to(dtype)
    if len(new) > 2:          # -0 and NaN in one sequence, huge logits in another: rows never mix
        q[0] = -0.0
        kc[int(bt[2, 0]), 0, 1] = float("nan")
        q[-1, 1] = 3e3 if dtype != torch.float16 else 6e4
    ctx_t = torch.tensor(ctx, dtype=torch.int32)
    got = paged_attention_reference(q, kc, vc, bt, cu, ctx_t, 0.25, causal)
    want = _paged_before(q, kc, vc, bt, cu, ctx_t, 0.25, causal)
    iv = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    assert torch.equal(got[0].view(iv), want[0].view(iv)), f"out {new} {ctx}"
    assert_same_bits(got[1], want[1], f"lse2 {new} {ctx}")


def test_paged_decode_rows_of_short_sequences_beside_long_ones_keep_their_bits():
    """One-key and one-block sequences beside a 130-key one: the short rows are left as they are at
    the longer one's later blocks."""
    from isoexec_kernels.attention.reference import paged_attention_reference

    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, page = 4, 2, 16, 64
    kc = torch.randn(5, page, hkv, d, generator=gen)
    vc = torch.randn(5, page, hkv, d, generator=gen)
    vc[0, 0] = -0.0
    bt = torch.tensor([[0, 0, 0], [1, 2, 3], [4, 0, 0]], dtype=torch.int32)
    q = torch.randn(3, hq, d, generator=gen)
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    ctx = torch.tensor([1, 130, 64], dtype=torch.int32)
    got = paged_attention_reference(q, kc, vc, bt, cu, ctx, 0.25)
    want = _paged_before(q, kc, vc, bt, cu, ctx, 0.25)
    assert_same_bits(got[0], want[0], "out")
    assert_same_bits(got[1], want[1], "lse2")
    assert bool(torch.isfinite(got[0]).all()), "the rows went side by side (no NaN to send them alone)"


# ---------------------------------------------------------------------------------------------
# moe: the experts in one pass (grouped linear) against the per-expert loop
# ---------------------------------------------------------------------------------------------

def _moe_case(T, E, k, H, I, dtype, seed, nan=False):
    from isoexec_kernels.moe.reference import dispatch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) * 0.2).to(dtype)
    down = (torch.randn(E, H, I, generator=gen) * 0.2).to(dtype)
    # top-k ids with one expert left without rows
    scores = torch.rand(T, E, generator=gen)
    scores[:, E - 1] = -1.0
    ids = scores.topk(k, dim=1).indices
    if T:
        x[0] = -0.0
    if nan and T > 3:
        x[2, 1] = float("nan")
        if dtype == torch.float32:
            x[3, 2] = nan_with_payload(dtype, 0x77, negative=True)
            gate_up[int(ids[3, 0]), 5, 2] = nan_with_payload(dtype, 0x99)
    return x, dispatch(ids, E), gate_up, down


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,I", [(64, 32), (100, 24), (130, 70)])
def test_experts_in_one_pass_give_the_per_expert_loop_bits(dtype, H, I):
    from isoexec_kernels.activation.reference import silu_and_mul_reference
    from isoexec_kernels.gemm.reference import linear_reference
    from isoexec_kernels.moe.reference import experts_forward, experts_forward_grouped

    iv = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    for T, nan in ((1, False), (7, False), (40, True), (0, False)):
        x, disp, gate_up, down = _moe_case(T, 6, 2, H, I, dtype, seed=T + H, nan=nan)
        got = experts_forward_grouped(x, disp, gate_up, down)
        want = experts_forward(x, disp, gate_up, down, linear_reference, silu_and_mul_reference)
        assert torch.equal(got.view(iv), want.view(iv)), f"experts T={T} H={H} I={I} {dtype}"
        if nan:
            assert bool(torch.isnan(got.float()).any()), "the NaN rows went through the loop again"


def test_grouped_linear_gives_each_groups_linear_bits_with_k_leaves(monkeypatch):
    from isoexec_kernels.gemm import reference as GR

    gen = torch.Generator().manual_seed(21)
    G, N, K, R = 3, 24, 200, 33
    monkeypatch.setitem(GR.K_LEAVES, (N, K), 3)       # three K leaves (blocks 0 | 1 | 2-3)
    x = specials((R, K), torch.float32, gen, frac=0.01)
    w = torch.randn(G, N, K, generator=gen)
    group = torch.randint(0, G, (R,), generator=gen)
    got = GR.grouped_linear_reference(x, w, group)
    for g in range(G):
        rows = (group == g).nonzero().flatten()
        assert_same_bits(got[rows], GR.linear_reference(x[rows], w[g]), f"group {g}")
