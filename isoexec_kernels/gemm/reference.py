"""The linear layer: the fixed-order torch twin (runs on any device; the CPU path of the public API).
The rounding schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import torch

from .. import _ref


BLOCK_K = 64
"""K block of every path (reference tree width, Triton K tile). Pinned in the contract."""
# Bias-add leaf width for grad_b (sum over tokens) in the backward.
_GRAD_BIAS_LEAF = 64


def block_k_for(N: int, K: int) -> int:
    """BLOCK_K as a function of the weight shape only. Constant today (64); keyed on (N, K) so
    a future table can never depend on M."""
    return BLOCK_K


# K leaves per weight shape (N, K). A shape with few output tiles (small N) can cut its K into
# leaves, so that a small batch spreads one tile's K over several programs (split-K) and still
# gets the bits a large batch gets from one program walking the leaves in turn. Measured on the
# H200 (scripts/gemm_tile_sweep.py --leaves, commit 26feb16, README "Kernels"): 2-8 leaves make
# Qwen3-0.6B o_proj/down_proj and Qwen3-8B o_proj 1.3-1.6x faster at M <= 64, but today's
# one-program leaf walk costs 6-25% at M >= 2048 (each leaf restarts the K pipeline and two fp32
# tiles must stay live, ruling out 128 x 256 tiles; one K loop over all leaves, tried at commit 5e63404,
# was slower still: results/h200/bench/gemm_leafflat_sweep.json). Until the walk is cheaper no shape is
# listed: every shape has 1 leaf, the schedule of the plain K loop.
K_LEAVES: dict[tuple[int, int], int] = {}
def k_leaves_for(N: int, K: int) -> int:
    """Number of K leaves for a weight [N, K]: a function of the weight shape only (never of M),
    at most the number of K blocks. Pinned by the contract through the impl version."""
    return max(1, min(K_LEAVES.get((int(N), int(K)), 1), num_k_blocks(K)))


def num_k_blocks(K: int) -> int:
    return max(1, -(-int(K) // BLOCK_K))


def leaf_bounds(K: int, leaves: int) -> list[tuple[int, int]]:
    """K-block ranges ``[b0, b1)`` of each leaf: block counts split as evenly as possible, the
    larger leaves last (leaf j starts at block ``j * nb // leaves``)."""
    nb = num_k_blocks(K)
    if not 1 <= leaves <= nb:
        raise ValueError(f"linear: {leaves} K leaves for K={K} ({nb} blocks of {BLOCK_K}); "
                         f"need 1 <= leaves <= {nb}")
    return [(j * nb // leaves, (j + 1) * nb // leaves) for j in range(leaves)]


_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def leaf_slice_columns(x: torch.Tensor, weight: torch.Tensor, in_features: int, leaves: int,
                       first_leaf: int, count: int) -> list[tuple[int, int]]:
    """Column ranges ``[a, b)`` in a K slice of leaves ``first_leaf .. first_leaf + count - 1`` of
    the ``leaves`` K leaves of ``in_features`` columns (the leaves side by side, from the first's
    first column), after checking that ``x [M, w]`` and ``weight [N, w]`` are that slice; one
    error naming the problem otherwise (a dtype: TypeError, as :func:`_check` raises)."""
    what = "leaf_partials"
    nb = num_k_blocks(in_features)
    if in_features < 1 or not 1 <= leaves <= nb:
        raise ValueError(f"{what}: {leaves} K leaves for in_features={in_features} ({nb} blocks of {BLOCK_K}); "
                         f"need in_features >= 1 and 1 <= leaves <= {nb}")
    if count < 1 or first_leaf < 0 or first_leaf + count > leaves:
        raise ValueError(f"{what}: leaves {first_leaf} .. {first_leaf + count - 1} (first_leaf={first_leaf}, "
                         f"count={count}) are not among the {leaves} leaves 0 .. {leaves - 1}")
    if x.dtype not in _OUT_DTYPES or weight.dtype != x.dtype:
        raise TypeError(f"{what}: x and weight must share one of {_OUT_DTYPES}, got {x.dtype} and {weight.dtype}")
    bounds = leaf_bounds(in_features, leaves)[first_leaf:first_leaf + count]
    k0, k1 = bounds[0][0] * BLOCK_K, min(in_features, bounds[-1][1] * BLOCK_K)
    if x.dim() != 2 or x.shape[1] != k1 - k0:
        raise ValueError(f"{what}: leaves {first_leaf} .. {first_leaf + count - 1} of {leaves} are columns "
                         f"[{k0}, {k1}) of {in_features}, so x must be [M, {k1 - k0}], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != k1 - k0:
        raise ValueError(f"{what}: leaves {first_leaf} .. {first_leaf + count - 1} of {leaves} are columns "
                         f"[{k0}, {k1}) of {in_features}, so weight must be [N, {k1 - k0}], got shape "
                         f"{tuple(weight.shape)}")
    return [(b0 * BLOCK_K - k0, min(in_features, b1 * BLOCK_K) - k0) for b0, b1 in bounds]


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           out_dtype: torch.dtype | None = None, residual: torch.Tensor | None = None) -> None:
    if out_dtype is not None and out_dtype not in _OUT_DTYPES:
        raise TypeError(f"linear: out_dtype must be one of {_OUT_DTYPES} or None, got {out_dtype}")
    if weight.dim() != 2:
        raise ValueError(f"linear: weight must be [N, K], got shape {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: x has K={x.shape[-1]} but weight is {tuple(weight.shape)} (expected [N, K])"
        )
    if x.dtype != weight.dtype:
        raise TypeError(f"linear: x is {x.dtype} but weight is {weight.dtype}; cast one of them")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"linear: bias must be [N]={weight.shape[0]}, got {tuple(bias.shape)}")
    if residual is not None:
        want = (*x.shape[:-1], weight.shape[0])
        if tuple(residual.shape) != want:
            raise ValueError(f"linear: residual must have the output's shape {want}, got {tuple(residual.shape)}")
        if residual.dtype != (out_dtype or x.dtype):
            raise TypeError(f"linear: residual is {residual.dtype} but the output is {out_dtype or x.dtype}")


def _reference_2d(x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                  leaves: int | None = None, out_dtype: torch.dtype | None = None,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    out = _reference_2d_acc(x2, w, bias, leaves, out_dtype)
    # the residual stream's add after the one rounding: torch's elementwise add of two tensors
    # of the output dtype, which the Triton epilogue reproduces
    return out if residual is None else out + residual.reshape(out.shape)


def _reference_2d_acc(x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                      leaves: int | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    M, K = x2.shape
    N = w.shape[0]
    leaves = k_leaves_for(N, K) if leaves is None else leaves
    out_dtype = out_dtype or x2.dtype
    acc_out = torch.empty((M, N), dtype=torch.float32, device=x2.device)
    if M == 0 or N == 0:
        return acc_out.to(out_dtype)
    # Weight blocks, K-major: wT[k, n]. fp32 conversion of bf16/fp16 is exact.
    wf = w.float()
    blocks = []
    for k0 in range(0, K, BLOCK_K):
        blocks.append((k0, min(K, k0 + BLOCK_K), wf[:, k0:k0 + BLOCK_K].t().contiguous()))
    bounds = leaf_bounds(K, leaves) if K > 0 else [(0, 0)]
    xf = x2.float()
    rows = min(M, _ref.rows_per_chunk(BLOCK_K * N))
    scratch = torch.empty(BLOCK_K * rows * N, dtype=torch.float32, device=x2.device)
    for r0 in range(0, M, rows):
        xc = xf[r0:r0 + rows]
        m = xc.shape[0]
        total = None
        for b0, b1 in bounds:
            # one leaf: its blocks accumulated in K order from +0
            acc = torch.zeros((m, N), dtype=torch.float32, device=x2.device)
            for k0, k1, wT in blocks[b0:b1]:
                bk = k1 - k0
                p = 1 << (bk - 1).bit_length()  # last block: zero-pad to a power of two
                prod = scratch[:p * m * N].view(p, m, N)
                # exact-rounded fp32 products, K-major so each tree level is one contiguous add
                torch.mul(xc[:, k0:k1].t().contiguous()[:, :, None], wT[:, None, :], out=prod[:bk])
                if p > bk:
                    prod[bk:].zero_()
                acc.add_(_ref.tree_sum0_(prod))
            # leaves summed left to right, the first leaf taken as it is (no +0 start)
            total = acc if total is None else total.add_(acc)
        acc_out[r0:r0 + rows] = total
    if bias is not None:
        acc_out = acc_out + bias.float()
    return acc_out.to(out_dtype)


def grouped_linear_reference(x: torch.Tensor, weight: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Row r of ``x [R, K]`` times ``weight[group[r]] [N, K]`` transposed, for weights ``[G, N, K]``
    (the experts of an MoE layer): ``[R, N]`` in x's dtype, each row with the bits of
    ``linear_reference(x[r], weight[group[r]])`` (no bias, the output in x's dtype). The schedule
    of :func:`_reference_2d_acc` with each row's products taken against its own group's weight
    block (gathered per row): the same products, the same tree per block, the same leaves; rows
    never mix, so taking the groups in one pass changes no bits."""
    R, K = x.shape
    G, N, _ = weight.shape
    leaves = k_leaves_for(N, K)
    acc_out = torch.empty((R, N), dtype=torch.float32, device=x.device)
    if R == 0 or N == 0:
        return acc_out.to(x.dtype)
    wf = weight.float()
    blocks = [(k0, min(K, k0 + BLOCK_K)) for k0 in range(0, K, BLOCK_K)]
    wT = [wf[:, :, k0:k1].permute(2, 0, 1) for k0, k1 in blocks]                 # [bk, G, N] views
    bounds = leaf_bounds(K, leaves) if K > 0 else [(0, 0)]
    xf = x.float()
    rows = min(R, _ref.rows_per_chunk(BLOCK_K * N))
    scratch = torch.empty(BLOCK_K * rows * N, dtype=torch.float32, device=x.device)
    for r0 in range(0, R, rows):
        xc = xf[r0:r0 + rows]
        gc = group[r0:r0 + rows]
        m = xc.shape[0]
        total = None
        for b0, b1 in bounds:
            acc = torch.zeros((m, N), dtype=torch.float32, device=x.device)
            for (k0, k1), wTb in zip(blocks[b0:b1], wT[b0:b1]):
                bk = k1 - k0
                p = 1 << (bk - 1).bit_length()
                prod = scratch[:p * m * N].view(p, m, N)
                torch.mul(xc[:, k0:k1].t()[:, :, None], wTb[:, gc, :], out=prod[:bk])
                if p > bk:
                    prod[bk:].zero_()
                acc.add_(_ref.tree_sum0_(prod))
            total = acc if total is None else total.add_(acc)
        acc_out[r0:r0 + rows] = total
    return acc_out.to(x.dtype)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     leaves: int | None = None, out_dtype: torch.dtype | None = None,
                     residual: torch.Tensor | None = None):
    """``x[..., K] @ weight[N, K].T (+ bias[N])`` -> ``[..., N]`` in ``out_dtype`` (default
    x.dtype), by the reference schedule (api.py's docstring): fp32 products, halves tree per
    64-wide K block, blocks accumulated in K order from +0 within each K leaf, the leaves summed
    left to right, bias in fp32, one rounding to ``out_dtype`` (none for fp32), then
    ``+ residual`` if given (an elementwise add in that dtype). ``leaves`` overrides
    :func:`k_leaves_for` (tests). Not differentiable by itself (use :func:`linear`)."""
    _check(x, weight, bias, out_dtype, residual)
    K = x.shape[-1]
    out = _reference_2d(x.reshape(-1, K), weight, bias, leaves, out_dtype, residual)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def leaf_sum_reference(partials: torch.Tensor, bias: torch.Tensor | None = None,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[L, M, N] fp32 leaf partials -> [M, N]: the leaves added left to right in fp32 (the first
    as it is, no +0 start), then the bias in fp32, then one rounding to ``out_dtype``: the
    invariant linear's epilogue after its leaves (``_reference_2d_acc``, the Triton kernels)."""
    total = partials[0].clone()
    for j in range(1, partials.shape[0]):
        total.add_(partials[j])
    if bias is not None:
        total = total + bias.float()
    return total.to(out_dtype)


def leaf_partials_reference(x: torch.Tensor, weight: torch.Tensor, *, in_features: int, leaves: int,
                            first_leaf: int, count: int) -> torch.Tensor:
    """fp32 ``[count, M, N]``: the accumulator of each of leaves ``first_leaf ..`` of the
    reference schedule, from the K slice that holds them (api.py's ``leaf_partials``): each leaf
    is :func:`linear_reference` of its own columns with one leaf and an fp32 output, which is
    the leaf as the whole K loop computes it (its blocks start on a block bound of the whole K
    and are zero-padded the same way)."""
    cols = leaf_slice_columns(x, weight, in_features, leaves, first_leaf, count)
    return torch.stack([_reference_2d(x[:, a:b], weight[:, a:b], None, leaves=1, out_dtype=torch.float32)
                        for a, b in cols])
