"""The collective steps the parallel layers use, and why no other.

Only ``all_gather`` (tensor parallelism) and ``all_to_all`` (expert parallelism: rows sent to the
rank that owns their expert and back; the row-parallel linear's column owners: each rank's partials
of a block of output columns sent to that block's owner) move data between ranks here. Both copy bytes and add
nothing, so what a rank receives is bit for bit what the others computed, in rank order; any sum
that follows runs on every rank in one order the caller fixes. ``all_reduce(SUM)`` would be shorter, but it adds in an order
chosen by the backend from the group size, the tensor size and the algorithm (ring, tree,
halving-doubling), so its bits change with tp (tests/dist/ shows it on this CPU).

A group of size 1, or no initialised process group at all with ``group=None``, is one process:
nothing is sent, and the layers run the same arithmetic, so TP = 1 needs no process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size_rank(group=None) -> tuple[int, int]:
    """(tp, rank in the group) of ``group``; (1, 0) for ``group=None`` without an initialised
    default group."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def gather_in_rank_order(t: torch.Tensor, group, tp: int) -> torch.Tensor:
    """``[tp, *t.shape]``: every rank's ``t`` stacked in group-rank order (the same shape and dtype
    on every rank; pad uneven shards first). Tensors travel as their raw bytes (uint8), so the
    backend copies bits whatever dtypes it supports (gloo refuses an int16 all_gather here), and
    a -0 or a NaN payload arrives as it was sent."""
    if tp == 1:
        return t.unsqueeze(0)
    payload = t.contiguous().reshape(-1).view(torch.uint8)
    parts = [torch.empty_like(payload) for _ in range(tp)]
    dist.all_gather(parts, payload, group=group)
    return torch.stack(parts).view(t.dtype).reshape(tp, *t.shape)


def gather_columns_in_rank_order(part: torch.Tensor, widths: list[int], group, tp: int) -> torch.Tensor:
    """Every rank's ``part [..., widths[r]]`` side by side in rank order, ``[..., sum(widths)]``: the
    blocks padded to the widest to travel (``gather_in_rank_order``), the padding dropped. A copy."""
    widest = max(widths)
    every = gather_in_rank_order(torch.nn.functional.pad(part, (0, widest - part.shape[-1])), group, tp)
    return torch.cat([every[r, ..., :w] for r, w in enumerate(widths)], dim=-1)


def sum_in_rank_order(t: torch.Tensor, group, tp: int) -> torch.Tensor:
    """The sum of every rank's ``t``, the same bits on every rank: gathered, then added left to
    right in rank order (rank 0's taken as it is). Deterministic for a given tp, not invariant
    across tp: the backward passes use it, where only determinism is required
    (docs/variance_sources.md, "Only forward bits must match")."""
    if tp == 1:
        return t
    parts = gather_in_rank_order(t, group, tp)
    total = parts[0].clone()
    for r in range(1, tp):
        total.add_(parts[r])
    return total


def all_to_all_rows(rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], group,
                    ep: int) -> torch.Tensor:
    """Rows exchanged between the ranks of ``group``: ``rows [sum(send_counts), *row]`` holds, in
    rank order, ``send_counts[q]`` rows for rank q; returns ``[sum(recv_counts), *row]``, in rank
    order, the ``recv_counts[s]`` rows rank s sent here (in the order it sent them). The counts
    must agree pairwise (what s sends to q is what q expects from s). The rows travel as raw bytes
    (uint8) like ``gather_in_rank_order``: no backend dtype rule touches them. A copy, no
    arithmetic; not differentiable."""
    shape = tuple(rows.shape[1:])
    if ep == 1:
        return rows
    row_bytes = rows.element_size() * (1 if not shape else int(torch.Size(shape).numel()))
    payload = rows.contiguous().reshape(-1).view(torch.uint8)
    out = torch.empty(sum(recv_counts) * row_bytes, dtype=torch.uint8, device=rows.device)
    dist.all_to_all_single(out, payload, [c * row_bytes for c in recv_counts],
                           [c * row_bytes for c in send_counts], group=group)
    return out.view(rows.dtype).reshape(sum(recv_counts), *shape)
