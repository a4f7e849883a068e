"""Which slice each rank holds: whole K leaves, whole 64-column units, whole vocabulary leaves, and a
data-parallel rank's run of sequences, in rank order and covering the dimension; the refusals
(and the mesh-shape check) name the sizes. No process group needed."""

from __future__ import annotations

import pytest

from isoexec.dist import column_shard_range, row_shard_range, vocab_shard_range, vocab_shard_unit
from isoexec.dist.mesh import check_mesh_shape
from isoexec.dist.partition import row_shard_leaves, sequence_share
from isoexec_kernels.gemm import BLOCK_K, leaf_bounds
from isoexec_kernels.logprob import BLOCK_V, REF_LEAF_V


def _covers(ranges, n):
    return ranges[0][0] == 0 and ranges[-1][1] == n and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) \
        and all(a < b for a, b in ranges)


@pytest.mark.parametrize("K", [64, 65, 337, 600, 1024, 4096 + 17])
def test_row_shards_are_whole_leaves_in_rank_order(K):
    nb = -(-K // BLOCK_K)
    for L in range(1, min(nb, 8) + 1):
        leaves = [(b0 * BLOCK_K, min(K, b1 * BLOCK_K)) for b0, b1 in leaf_bounds(K, L)]
        for tp in (t for t in (1, 2, 4, 8) if L % t == 0):
            mine = [row_shard_leaves(K, L, tp, r) for r in range(tp)]
            assert sum(mine, []) == leaves   # rank r holds leaves r*L/tp .. (r+1)*L/tp - 1
            assert _covers([row_shard_range(K, L, tp, r) for r in range(tp)], K)


@pytest.mark.parametrize("I", [64, 200, 256, 600, 3072, 4096 + 100])
def test_column_shards_in_64_column_units_are_the_next_row_parallel_layer_s_leaves(I):
    nb = -(-I // BLOCK_K)
    for L in (1, 2, 4, 8):
        if L > nb:
            continue
        for tp in (t for t in (1, 2, 4, 8) if L % t == 0):
            assert [column_shard_range(I, tp, r, BLOCK_K) for r in range(tp)] == \
                   [row_shard_range(I, L, tp, r) for r in range(tp)], (I, L, tp)


def test_column_and_vocab_shards_cover_the_dimension_in_whole_units():
    for N, unit in ((203, 1), (200, BLOCK_K), (4096, 128)):
        for tp in (1, 2, 3, 4):
            ranges = [column_shard_range(N, tp, r, unit) for r in range(tp)]
            assert _covers(ranges, N) and all(a % unit == 0 for a, _ in ranges)
    for V in (1024, 4396, 9000, 151936, 151937):
        for tp in (1, 2, 4, 8):
            if -(-V // REF_LEAF_V) < tp:
                continue
            ranges = [vocab_shard_range(V, tp, r) for r in range(tp)]
            # whole reference leaves always; whole Triton chunks whenever there are enough of them
            unit = BLOCK_V if -(-V // BLOCK_V) >= tp else REF_LEAF_V
            assert vocab_shard_unit(V, tp) == unit
            assert _covers(ranges, V) and all(a % unit == 0 for a, _ in ranges), (V, tp, ranges)
    # Qwen3's 151,936 logits are 38 chunks of 4096 (the last 384 wide): 19 a rank at TP = 2
    assert [vocab_shard_range(151936, 2, r) for r in range(2)] == [(0, 19 * 4096), (19 * 4096, 151936)]
    # 4396 logits at TP = 4: two chunks only, so leaves of 1024 (5 leaves: 1, 1, 1, 2)
    assert [vocab_shard_range(4396, 4, r) for r in range(4)] == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4396)]


def test_data_parallel_ranks_take_contiguous_equal_runs_of_sequences_in_rank_order():
    for n in (1, 2, 4, 8, 12):
        for dp in (d for d in (1, 2, 4) if n % d == 0):
            ranges = [sequence_share(n, dp, r) for r in range(dp)]
            assert _covers(ranges, n) and {b - a for a, b in ranges} == {n // dp}
    assert [sequence_share(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]


@pytest.mark.parametrize("call, words", [
    (lambda: sequence_share(6, 4, 0), ["6 sequence(s)", "dp=4"]),
    (lambda: sequence_share(0, 1, 0), ["0 sequence(s)"]),
    (lambda: sequence_share(4, 2, 2), ["rank 2", "size 2"]),
    (lambda: check_mesh_shape((3,), 2), ["(3,)", "3 rank(s)", "2 process(es)"]),
    (lambda: check_mesh_shape((2, 0), 0), ["(2, 0)"]),
    (lambda: row_shard_range(337, 4, 3, 0), ["tp=3", "L=4"]),
    (lambda: row_shard_range(337, 3, 2, 1), ["tp=2", "L=3"]),
    (lambda: row_shard_range(337, 7, 1, 0), ["L=7", "in_features=337", "6 blocks"]),
    (lambda: row_shard_range(337, 0, 1, 0), ["L=0"]),
    (lambda: row_shard_range(0, 1, 1, 0), ["in_features=0"]),
    (lambda: row_shard_range(337, 4, 2, 2), ["rank 2", "size 2"]),
    (lambda: column_shard_range(3, 4, 0), ["out_features=3", "tp=4"]),
    (lambda: column_shard_range(200, 8, 0, BLOCK_K), ["out_features=200", "4 unit(s) of 64", "tp=8"]),
    (lambda: column_shard_range(200, 2, 0, 0), ["unit=0"]),
    (lambda: vocab_shard_range(3000, 4, 0), ["vocab_size=3000", "3 leaf", "tp=4"]),
    (lambda: vocab_shard_range(4396, 2, -1), ["rank -1"]),
])
def test_a_bad_size_raises_one_value_error_naming_it(call, words):
    with pytest.raises(ValueError) as e:
        call()
    assert all(w in str(e.value) for w in words), str(e.value)
