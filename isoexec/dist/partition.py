"""Which contiguous slice of a dimension each rank of a tensor-parallel group holds, which experts
each expert-parallel rank owns (``expert_shard_range``), and which sequences of a batch each
data-parallel rank takes (``sequence_share``, at the end).

Every split here cuts a dimension into the fixed units of a kernel's own schedule (64-wide K blocks
grouped into K leaves, vocabulary chunks of ``BLOCK_V`` or leaves of ``REF_LEAF_V`` logits), never
into arbitrary column counts: a rank then computes whole units, each exactly as one process computes it, and only the order in
which units are added remains to be fixed (row_parallel.py, vocab_parallel_logprob.py). Units are
dealt out as ``leaf_bounds`` deals K blocks to leaves: part j of n units into p parts starts at unit
``j * n // p`` (as even as possible, the larger parts last). That shared rule is what lets a
column-parallel layer cut in 64-column units feed a row-parallel layer cut in K leaves: with tp
dividing L, rank r's leaves are K blocks ``[r * nb // tp, (r + 1) * nb // tp)``, the same blocks
as rank r's 64-column units of the layer before.

A bad size raises one ValueError naming the sizes; the checks are local to each rank and identical
on every rank (they see the same sizes), so all ranks refuse together, before any collective.
"""

from __future__ import annotations

from isoexec_kernels.gemm import BLOCK_K, leaf_bounds
from isoexec_kernels.gemm.reference import num_k_blocks
from isoexec_kernels.logprob import BLOCK_V, REF_LEAF_V


def _check_rank(what: str, tp: int, rank: int) -> None:
    if tp < 1 or not 0 <= rank < tp:
        raise ValueError(f"{what}: rank {rank} of a group of size {tp}; need a size >= 1 and 0 <= rank < size")


def _part(n_units: int, parts: int, j: int) -> tuple[int, int]:
    return j * n_units // parts, (j + 1) * n_units // parts


def _unit_range(what: str, size_text: str, total: int, unit: int, units_text: str, need: str,
                tp: int, rank: int) -> tuple[int, int]:
    """``[i0, i1)`` of rank ``rank``: ``total`` cut into ``unit``-wide units (the last may be short),
    whole units per rank, counts differing by at most one; refuses fewer units than ranks."""
    n_units = -(-total // unit)
    if tp < 1 or n_units < tp:
        raise ValueError(f"{what}: {size_text} is {n_units} {units_text}, fewer than tp={tp}; "
                         f"every rank needs {need}")
    _check_rank(what, tp, rank)
    u0, u1 = _part(n_units, tp, rank)
    return u0 * unit, min(total, u1 * unit)


def row_shard_leaves(in_features: int, leaves: int, tp: int, rank: int) -> list[tuple[int, int]]:
    """K column ranges ``[k0, k1)`` of the K leaves rank ``rank`` holds in a row-parallel linear
    with ``leaves`` (L) K leaves: leaves ``rank * L / tp`` to ``(rank + 1) * L / tp - 1``. Refuses an
    L the weight cannot have and a tp that does not divide L."""
    what = "row-parallel linear"
    if in_features < 1:
        raise ValueError(f"{what}: in_features={in_features}; need at least one input column")
    nb = num_k_blocks(in_features)
    if not 1 <= leaves <= nb:
        raise ValueError(f"{what}: L={leaves} K leaves for in_features={in_features} ({nb} blocks of "
                         f"{BLOCK_K}); need 1 <= L <= {nb}")
    if tp < 1 or leaves % tp:
        raise ValueError(f"{what}: tp={tp} does not divide the L={leaves} K leaves; each rank must hold "
                         f"L/tp whole leaves (pick L, a contract constant, divisible by every TP size served)")
    _check_rank(what, tp, rank)
    per = leaves // tp
    bounds = leaf_bounds(in_features, leaves)[rank * per:(rank + 1) * per]
    return [(b0 * BLOCK_K, min(in_features, b1 * BLOCK_K)) for b0, b1 in bounds]


def row_shard_range(in_features: int, leaves: int, tp: int, rank: int) -> tuple[int, int]:
    """Input columns ``[k0, k1)`` rank ``rank`` holds in a row-parallel linear (its K leaves side
    by side): the slice of the input and of the weight's columns it is given."""
    mine = row_shard_leaves(in_features, leaves, tp, rank)
    return mine[0][0], mine[-1][1]


def column_shard_range(out_features: int, tp: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """Output columns ``[n0, n1)`` rank ``rank`` computes in a column-parallel linear, N cut into
    ``unit``-wide units (the last may be short). ``unit = BLOCK_K`` (64) lines the shards up with
    the K leaves of a row-parallel layer that reads this output (module docstring); a head's width
    keeps heads whole."""
    if unit < 1:
        raise ValueError(f"column-parallel linear: unit={unit}; need a positive number of columns per unit")
    return _unit_range("column-parallel linear", f"out_features={out_features}", out_features, unit,
                       f"unit(s) of {unit} columns", "at least one unit", tp, rank)


def vocab_shard_unit(vocab_size: int, tp: int) -> int:
    """The width of the units the vocabulary is dealt out in at size ``tp``: the Triton logprob
    schedule's chunk (``BLOCK_V`` = 4096 logits) when the vocabulary has at least ``tp`` of them, else
    the reference schedule's leaf (``REF_LEAF_V`` = 1024). A chunk is four whole leaves, so every
    rank holds whole leaves of the reference either way, and whole chunks of the Triton schedule
    whenever the vocabulary allows (vocab_parallel_logprob.py); every rank gets the same answer."""
    return BLOCK_V if -(-vocab_size // BLOCK_V) >= tp else REF_LEAF_V


def vocab_shard_range(vocab_size: int, tp: int, rank: int) -> tuple[int, int]:
    """Vocabulary columns ``[v0, v1)`` rank ``rank`` holds in a vocabulary-parallel logprob: V cut
    into units of :func:`vocab_shard_unit` logits (the last may be short), whole units per rank.
    Vocabulary sizes rarely divide evenly (Qwen3's 151,936 is 38 chunks of 4096, the last 384
    wide), so the unit counts may differ by one between ranks. Refuses fewer reference leaves than
    ranks."""
    unit = vocab_shard_unit(vocab_size, tp)
    return _unit_range("vocab-parallel logprob", f"vocab_size={vocab_size}", vocab_size, unit,
                       # only the leaf unit can be refused: the chunk is taken when there are enough
                       f"leaf/leaves of {REF_LEAF_V} logits", "at least one whole leaf", tp, rank)


def expert_shard_range(num_experts: int, ep: int, rank: int) -> tuple[int, int]:
    """Experts ``[e0, e1)`` expert-parallel rank ``rank`` of ``ep`` owns: whole experts in one
    contiguous range, part j of E over ep starting at ``j * E // ep`` (the rule above; when ep
    does not divide E the counts differ by one: 6 over 4 is 1, 2, 1, 2). Contiguous ranges in rank order keep a token's chosen
    experts, listed in ascending index, grouped by owner in rank order (expert_parallel.py).
    Refuses ``ep > E``: a rank without an expert would hold no weights for the layer."""
    if ep < 1 or num_experts < ep:
        raise ValueError(f"expert parallelism: {num_experts} expert(s) cannot be dealt to ep={ep} rank(s); "
                         f"every rank needs at least one whole expert (need 1 <= ep <= {num_experts})")
    _check_rank("expert parallelism", ep, rank)
    return _part(num_experts, ep, rank)


def sequence_share(n_sequences: int, dp: int, rank: int) -> tuple[int, int]:
    """Sequences ``[s0, s1)`` data-parallel rank ``rank`` of ``dp`` takes from a batch of
    ``n_sequences``: the contiguous run ``rank * n / dp`` to ``(rank + 1) * n / dp``, by index.
    ``dp`` must divide ``n``: every rank takes the same number, and none is left without a
    sequence (an idle rank would miss the parameter all-gather the others wait in)."""
    if dp < 1 or n_sequences < 1 or n_sequences % dp:
        raise ValueError(f"data-parallel batch: {n_sequences} sequence(s) over dp={dp} rank(s); dp must divide "
                         "the sequence count so every rank takes the same number of whole sequences "
                         "(pick a batch and mini-batch size that are multiples of dp)")
    _check_rank("data-parallel batch", dp, rank)
    return _part(n_sequences, dp, rank)
