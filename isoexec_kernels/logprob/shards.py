"""The reference logprob schedule cut at vocabulary leaf boundaries: the pieces a caller that holds
only a slice of each row's logits (a vocabulary-parallel rank) computes, and the steps that join them.

The reference (api.py's docstring) reduces a row twice: a max, which is exact and so the same in any
order, and a sum of ``e_j = fp32(exp(z_j - m))`` over leaves of ``REF_LEAF_V`` logits (a halves tree
inside each leaf, the leaves accumulated left to right from +0). Each leaf's tree reads only its own
logits and the row's max, so a slice of the row that starts on a leaf boundary can compute its
leaves' sums alone, bit for bit the sums the whole row gives, once it knows the row's max. Only
the left-to-right chain over the leaves needs every leaf, and it is short (one value per leaf and
row): whoever holds all leaf sums runs :func:`lse_from_leaf_sums` and gets the reference's
``lse_rel``. The functions below are those steps, written with the same operations as
``reference._ref_stats`` so that the bits cannot drift apart; the tests compare them with it.
"""

from __future__ import annotations

import torch

from .. import _ref
from .reference import REF_LEAF_V


def row_max(z: torch.Tensor) -> torch.Tensor:
    """The raw max of each row of a slice ``z[R, Vs]`` (fp32). The max of a row is the max of its
    slices' maxes in any order; normalise the combined max with ``m + 0.0`` (-0 to +0) as the
    reference does."""
    return z.max(dim=-1).values


def leaf_sums(z: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Sum-exp of each ``REF_LEAF_V`` leaf of a vocabulary slice ``z[R, Vs]`` (fp32) that starts on
    a leaf boundary, under the whole row's normalised max ``m[R]``: fp32 ``[ceil(Vs / REF_LEAF_V),
    R]``, leaf by leaf the values ``_ref.blocked_sum`` adds in the reference (only the last leaf of
    the row may be short; a short leaf is zero-padded to a power of two, as there)."""
    zm = z - m[:, None]
    e = _ref.exp64(zm.double()).float()
    sums = [_ref.tree_sum0(e[:, v0:v0 + REF_LEAF_V].t().contiguous())
            for v0 in range(0, e.shape[1], REF_LEAF_V)]
    return torch.stack(sums) if sums else e.new_zeros((0, e.shape[0]))


def lse_from_leaf_sums(sums: torch.Tensor) -> torch.Tensor:
    """``lse_rel = fp32(log(s))`` from every leaf sum of the row in vocabulary order ``[L, R]``:
    ``s`` accumulated left to right from +0, as ``_ref.blocked_sum`` does."""
    s = sums.new_zeros(sums.shape[1:])
    for j in range(sums.shape[0]):
        s = s + sums[j]
    return _ref.log64(s.double()).float()


def token_grad(z: torch.Tensor, m: torch.Tensor, lse_rel: torch.Tensor, local_target: torch.Tensor,
               dy: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """d logprob / d logits on a slice ``z[R, Vs]``: ``(onehot - softmax) * dy`` rounded once to
    ``dtype``, with softmax_j = exp((z_j - m) - lse_rel) evaluated as the reference backward does
    (``_ref.exp64`` of the fp32 log-softmax). ``local_target[R]`` is the target's column in this
    slice, or -1 where another slice holds it. Elementwise given (m, lse_rel): the slices' results
    side by side are the whole row's bits."""
    ls = (z - m[:, None]) - lse_rel[:, None]
    p = _ref.exp64(ls.double()).float()
    onehot = torch.zeros_like(p)
    own = local_target >= 0
    rows = own.nonzero()[:, 0]
    onehot[rows, local_target[rows]] = 1.0
    return ((onehot - p) * dy.float()[:, None]).to(dtype)
