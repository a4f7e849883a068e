"""A row's total is the sum of its parts against the GPU's memory, and the verdict says by how much
it fits or not: a run whose KV pool exceeds the memory is reported as not fitting, with the pages
that would fit; one whose other states alone exceed it is told that fewer pages would not help."""

from dataclasses import replace

import pytest

from isoexec.compose import load_model_config
from isoexec.model_config import DenseConfig, HybridConfig
from isoexec.plan.engine_pools import TORCH_DTYPES, kv_bytes_per_page
from isoexec.plan.rows import GIB, plan_row
from isoexec.plan.workflow_config import RunShape


@pytest.fixture(scope="module")
def dense():
    return DenseConfig.from_hf(load_model_config("dense_tiny")["hf_config"])


def _shape(cfg, **kw):
    base = dict(family="dense", model="dense_tiny", cfg=cfg, arms=("isoexec",), dtype="bfloat16", dp=1, engine_tp=1,
                num_pages=100, page_size=16, num_state_slots=0, gdn_chunk=0, max_num_seqs=8,
                max_num_batched_tokens=256, micro_batch_budget=512, longest_sequence=40)
    base.update(kw)
    return RunShape(**base)


def test_the_total_is_the_sum_of_the_parts(dense):
    row = plan_row(_shape(dense), 80 * GIB)
    assert row.total == sum(row.states.values()) + row.kv_pool + row.recurrent_state + row.activations
    assert row.activations == max(row.trainer_activations, row.engine_activations)
    assert row.fits and row.verdict().startswith("fits, ")


def test_a_kv_pool_larger_than_the_memory_does_not_fit(dense):
    per_page = kv_bytes_per_page(dense, 16, "bfloat16")
    pages = 2 * GIB // per_page                     # a 2 GiB pool on a 1 GiB GPU
    row = plan_row(_shape(dense, num_pages=pages), 1 * GIB)
    assert row.kv_pool > row.capacity and not row.fits
    n = row.pages_that_fit()
    assert 0 < n < pages
    assert plan_row(_shape(dense, num_pages=n), 1 * GIB).fits
    assert not plan_row(_shape(dense, num_pages=n + 1), 1 * GIB).fits
    v = row.verdict()
    assert v.startswith("does not fit: over by ") and f"engine.num_pages <= {n:,}" in v


def test_when_the_rest_alone_is_too_big_fewer_pages_are_not_offered(dense):
    row = plan_row(_shape(dense), row_capacity := 1 << 20)     # 1 MiB
    assert not row.fits and row.total - row.kv_pool > row_capacity
    assert "without the KV pool" in row.verdict() and "num_pages" not in row.verdict()


def test_a_hybrid_row_holds_its_state_slots():
    cfg = HybridConfig.from_hf(load_model_config("hybrid_tiny")["hf_config"])
    shape = _shape(cfg, family="hybrid", model="hybrid_tiny", num_state_slots=8, gdn_chunk=64)
    row = plan_row(shape, 80 * GIB)
    assert row.recurrent_state > 0
    assert plan_row(replace(shape, num_state_slots=16), 80 * GIB).recurrent_state > row.recurrent_state


def test_a_chunk_form_core_s_state_slots_count_their_larger_buffers():
    from isoexec_kernels.gdn_core import GDNState

    cfg = HybridConfig.from_hf(load_model_config("hybrid_tiny")["hf_config"])
    shape = _shape(cfg, family="hybrid", model="hybrid_tiny", num_state_slots=8, gdn_chunk=64)
    plain, chunk_form = plan_row(shape, 80 * GIB), plan_row(replace(shape, gdn_chunk_form=True), 80 * GIB)
    dims = (1, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, "meta")
    one = GDNState.allocate(*dims, chunk=64, with_q=True, value_dtype=TORCH_DTYPES[shape.dtype])
    base = GDNState.allocate(*dims, chunk=64)
    # the chunk form's own buffers, and its values in the model dtype instead of fp32
    extra = sum(t.nbytes for t in (one.buf_q, one.buf_vn, one.buf_T, one.boundary_op, one.buf_vn_op))
    extra += one.buf_v.nbytes - base.buf_v.nbytes
    assert chunk_form.recurrent_state - plain.recurrent_state == (8 + 1) * len(cfg.gdn_layers) * extra


def test_more_gpus_shrink_only_the_sharded_states(dense):
    one, eight = plan_row(_shape(dense, dp=2), 80 * GIB), plan_row(_shape(dense, dp=8), 80 * GIB)
    for state in ("master", "adam"):
        assert abs(one.states[state] - 4 * eight.states[state]) <= 4
    for state in ("weights", "engine"):
        assert one.states[state] == eight.states[state]
    assert (one.kv_pool, one.activations) == (eight.kv_pool, eight.activations)


def test_a_tensor_parallel_engine_holds_its_rank_s_shards_and_kv_heads():
    """engine_tp: the engine column is the largest rank's shards as tp_dense cuts them (every
    sharded element on exactly one rank, the replicated ones on each), the KV pool the rank's heads."""
    from isoexec.model import DenseModel
    from isoexec.model.tensor_parallel import rank_parameter_count
    from isoexec.plan.params import count_parameters

    cfg = DenseConfig.from_hf(load_model_config("dense_tp_tiny")["hf_config"])
    whole, half = plan_row(_shape(cfg), 80 * GIB), plan_row(_shape(cfg, engine_tp=2), 80 * GIB)
    model = DenseModel(cfg, device="meta")
    counts = [rank_parameter_count(model, 2, r) for r in range(2)]
    p = count_parameters(cfg)
    replicated = p.embed + p.norms                 # tied embedding: no lm_head of its own
    assert sum(counts) == p.total + replicated
    assert half.states["engine"] == max(counts) * 2 < whole.states["engine"]
    assert half.kv_pool * 2 == whole.kv_pool
    assert {k: v for k, v in half.states.items() if k != "engine"} == \
        {k: v for k, v in whole.states.items() if k != "engine"}


def test_a_tensor_parallel_hybrid_engine_holds_its_shards_kv_heads_and_state_heads():
    """engine_tp for the hybrid family: the engine column is the largest rank's shards as
    tp_hybrid cuts them, the KV pool and the recurrent-state slots hold the rank's heads (half at
    engine_tp 2), the trainer's columns are untouched."""
    from isoexec.model import HybridModel
    from isoexec.model.tensor_parallel import rank_parameter_count

    cfg = HybridConfig.from_hf(load_model_config("hybrid_tp_tiny")["hf_config"])
    kw = dict(family="hybrid", model="hybrid_tp_tiny", num_state_slots=8, gdn_chunk=64)
    whole, half = plan_row(_shape(cfg, **kw), 80 * GIB), plan_row(_shape(cfg, engine_tp=2, **kw), 80 * GIB)
    counts = [rank_parameter_count(HybridModel(cfg, device="meta"), 2, r) for r in range(2)]
    assert sum(counts) > sum(p.numel() for p in HybridModel(cfg, device="meta").parameters()) > max(counts)
    assert half.states["engine"] == max(counts) * 2 < whole.states["engine"]
    assert half.kv_pool * 2 == whole.kv_pool
    # per-head state and conv channels halve; the per-slot bookkeeping (a few bytes a slot) does not
    assert 0 < whole.recurrent_state / 2 <= half.recurrent_state < 0.51 * whole.recurrent_state
    assert {k: v for k, v in half.states.items() if k != "engine"} == \
        {k: v for k, v in whole.states.items() if k != "engine"}
