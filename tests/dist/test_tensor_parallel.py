"""Tensor parallelism keeps the bits of one process: row-parallel linear (K leaves gathered and summed
in leaf order), column-parallel linear, and the vocabulary-parallel token logprob, at TP = 1, 2 and
4 on gloo (CPU), fp32 and bf16. One world per size runs every case (dist_workers.py), beside the
other files' cases (worlds.py); the single-process kernels run here from the same seeds. Bits
compared through integer views."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import dist_workers as dw  # noqa: E402
from isoexec.dist.row_parallel import row_parallel_linear_by_partials  # noqa: E402
from isoexec_kernels.gemm import linear  # noqa: E402
from isoexec_kernels.logprob import token_logprobs, token_logprobs_reference  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


@pytest.fixture(scope="module")
def worlds(tp_kernel_worlds):
    """{world size: [rank results]} for TP = 1, 2, 4 (conftest.py: one world per size for the folder)."""
    return tp_kernel_worlds


def _every_rank(worlds, key, field="out"):
    """(label, tensor) for every rank of every world size."""
    return [(f"TP={ws} rank {r}", res[key][field]) for ws, ranks in worlds.items() for r, res in enumerate(ranks)]


def _assert_all_equal(pairs, want, what):
    reports = {label: dw.bit_report(got, want) for label, got in pairs}
    bad = {label: rep for label, rep in reports.items() if rep["differing"]}
    assert not bad, f"{what}: differing elements per rank {bad}"


# ---------------------------------------------------------------------------------- row-parallel

@pytest.mark.parametrize("i", range(len(dw.ROW_CASES)), ids=[c[0] for c in dw.ROW_CASES])
def test_row_parallel_linear_tp1_tp2_tp4_bitwise_equal(worlds, i):
    key = f"row/{dw.ROW_CASES[i][0]}"
    _assert_all_equal(_every_rank(worlds, key), worlds[1][0][key]["out"], key)


@pytest.mark.parametrize("i", range(len(dw.ROW_CASES)), ids=[c[0] for c in dw.ROW_CASES])
def test_row_parallel_column_owners_combine_gives_the_same_bits_and_gradients_as_the_gather(worlds, i):
    # combine="owners": each rank sums its block of the output columns (all_to_all of the partials),
    # the rounded blocks gathered; N = 24 over 4 ranks is 6 columns a rank
    name, K, L = dw.ROW_CASES[i][:3]
    x, w, b, _ = dw.row_inputs(i)
    _assert_all_equal(_every_rank(worlds, f"row/{name}", "owners"), linear(x, w, b, leaves=L), name)
    for ws, ranks in worlds.items():
        for r, res in enumerate(ranks):
            res = res[f"row/{name}"]
            for g in ("gx", "gw"):
                rep = dw.bit_report(res[f"owners_{g}"], res[f"{g}0"])
                assert rep["differing"] == 0, (name, ws, r, g, rep)


@pytest.mark.parametrize("i", range(len(dw.ROW_CASES)), ids=[c[0] for c in dw.ROW_CASES])
def test_row_parallel_linear_equals_single_process_linear_with_the_same_leaves(worlds, i):
    name, K, L, N, dt, _ = dw.ROW_CASES[i]
    x, w, b, _ = dw.row_inputs(i)
    want = linear(x, w, b, leaves=L)
    _assert_all_equal(_every_rank(worlds, f"row/{name}"), want, f"{name} vs linear(leaves={L})")


@pytest.mark.parametrize("i", range(len(dw.ROW_CASES)), ids=[c[0] for c in dw.ROW_CASES])
def test_row_parallel_backward_is_deterministic_and_matches_float64(worlds, i):
    name, K, L, N, dt, with_bias = dw.ROW_CASES[i]
    x, w, b, probe = dw.row_inputs(i)
    # float64 gradients of sum(x @ w.T * probe): gx = probe @ w, gw = probe^T x, gb = sum probe
    p2, x2 = probe.double().reshape(-1, N), x.double().reshape(-1, K)
    want = {"gx": (p2 @ w.double()).reshape(x.shape), "gw": p2.t() @ x2, "gb": p2.sum(0)}
    tol = {"fp32": 1e-5, "bf16": 1e-2}[dt]
    for ws, ranks in worlds.items():
        for rank, res in enumerate(ranks):
            r = res[f"row/{name}"]
            k0, k1 = dw.row_shard_range(K, L, ws, rank)
            for g in ("gx", "gw") + (("gb",) if with_bias else ()):
                drift = dw.bit_report(r[g + "0"], r[g + "1"])["differing"]
                assert drift == 0, f"{name} TP={ws} rank {rank}: {g} drifts in {drift} elements"
                ref = want[g][..., k0:k1] if g != "gb" else want[g]
                err = (r[g + "0"].double() - ref).norm() / ref.norm()
                assert err < tol, f"{name} TP={ws} rank {rank}: {g} rel L2 {err:.2e} > {tol}"


@pytest.mark.parametrize("i", range(len(dw.ROW_CASES)), ids=[c[0] for c in dw.ROW_CASES])
def test_row_parallel_backward_on_the_cpu_twin_equals_the_single_process_backward(worlds, i):
    """Not required (the backward need only be deterministic): a fact of the CPU reference, whose
    output columns are computed independently, so sharding K moves no gradient bit."""
    name, K, L, N, dt, with_bias = dw.ROW_CASES[i]
    x, w, b, probe = dw.row_inputs(i)
    xs, wsw = x.clone().requires_grad_(), w.clone().requires_grad_()
    bs = None if b is None else b.clone().requires_grad_()
    (linear(xs, wsw, bs, leaves=L).float() * probe).sum().backward()
    for ws, ranks in worlds.items():
        for rank, res in enumerate(ranks):
            r = res[f"row/{name}"]
            k0, k1 = dw.row_shard_range(K, L, ws, rank)
            assert dw.bit_report(r["gx0"], xs.grad[..., k0:k1].contiguous())["differing"] == 0
            assert dw.bit_report(r["gw0"], wsw.grad[:, k0:k1].contiguous())["differing"] == 0
            if with_bias:
                assert dw.bit_report(r["gb0"], bs.grad)["differing"] == 0


def test_all_reduce_of_rank_partials_does_not_give_the_tp1_bits(worlds):
    """Negative control: each rank's K shard as one fp32 partial, summed by all_reduce(SUM), as a
    stock row-parallel layer does. It must differ from the single-process bits somewhere, or the
    row-parallel tests above show nothing."""
    counts = {}
    for i, (name, K, L, N, dt, _) in enumerate(dw.ROW_CASES):
        x, w, b, _ = dw.row_inputs(i)
        want = linear(x, w, b, leaves=L)
        for ws in (2, 4):
            counts[f"{name} TP={ws}"] = dw.bit_report(worlds[ws][0][f"row/{name}"]["all_reduce"], want)["differing"]
    print(f"\nall_reduce(SUM) of per-rank partials, elements differing from linear(leaves=L): {counts}")
    if not any(counts.values()):
        pytest.skip(f"all_reduce(SUM) happened to give the single-process bits for every input here: {counts}")
    assert any(counts.values())


def test_row_parallel_refuses_a_group_size_that_does_not_divide_the_leaves(worlds):
    assert worlds[1][0]["refuse/row_l3"] == "accepted"
    for ws in (2, 4):
        for res in worlds[ws]:
            msg = res["refuse/row_l3"]
            assert msg.startswith("ValueError") and f"tp={ws}" in msg and "L=3" in msg, msg


# ------------------------------------------------------------------------------- column-parallel

@pytest.mark.parametrize("i", range(len(dw.COL_CASES)), ids=[c[0] for c in dw.COL_CASES])
def test_column_parallel_linear_tp1_tp2_tp4_bitwise_equal_to_single_process_linear(worlds, i):
    name = dw.COL_CASES[i][0]
    x, w, b, _ = dw.col_inputs(i)
    _assert_all_equal(_every_rank(worlds, f"col/{name}"), linear(x, w, b), name)


@pytest.mark.parametrize("i", range(len(dw.COL_CASES)), ids=[c[0] for c in dw.COL_CASES])
def test_column_parallel_backward_is_deterministic_replicated_and_matches_float64(worlds, i):
    name, K, N, unit, dt = dw.COL_CASES[i]
    x, w, b, probe = dw.col_inputs(i)
    p2 = probe.double().reshape(-1, N)
    want_gx = (p2 @ w.double()).reshape(x.shape)
    want_gw = p2.t() @ x.double().reshape(-1, K)
    tol = {"fp32": 1e-5, "bf16": 1e-2}[dt]
    for ws, ranks in worlds.items():
        gx_rank0 = ranks[0][f"col/{name}"]["gx0"]
        for rank, res in enumerate(ranks):
            r = res[f"col/{name}"]
            n0, n1 = dw.column_shard_range(N, ws, rank, unit)
            for g in ("gx", "gw"):
                assert dw.bit_report(r[g + "0"], r[g + "1"])["differing"] == 0, f"{name} TP={ws}: {g} drifts"
            assert dw.bit_report(r["gx0"], gx_rank0)["differing"] == 0, f"{name} TP={ws}: gx not replicated"
            for got, ref in ((r["gx0"], want_gx), (r["gw0"], want_gw[n0:n1])):
                err = (got.double() - ref).norm() / ref.norm()
                assert err < tol, f"{name} TP={ws} rank {rank}: rel L2 {err:.2e} > {tol}"


def test_column_then_row_parallel_mlp_equals_single_process(worlds):
    """An up projection cut in 64-column units feeds a row-parallel down projection whose K leaves
    are the same columns: no gather between them, the single-process bits at the end."""
    x, w1, b1, w2, b2 = dw.mlp_inputs()
    want = linear(linear(x, w1, b1), w2, b2, leaves=dw.MLP["L"])
    assert all(res["mlp"]["shard_matches_row_range"] for ranks in worlds.values() for res in ranks)
    _assert_all_equal(_every_rank(worlds, "mlp"), want, "column -> row MLP")


# ------------------------------------------------------------------------------ vocab-parallel

@pytest.mark.parametrize("i", range(len(dw.VOCAB_CASES)), ids=[c[0] for c in dw.VOCAB_CASES])
def test_vocab_parallel_logprob_tp1_tp2_tp4_bitwise_equal_to_the_reference(worlds, i):
    name = dw.VOCAB_CASES[i][0]
    z, t, _ = dw.vocab_inputs(i)
    want = token_logprobs_reference(z, t)
    assert dw.bit_report(token_logprobs(z, t), want)["differing"] == 0   # CPU: the dispatcher runs it
    assert torch.isinf(z.reshape(-1, z.shape[-1])[3]).any() and not torch.isnan(want).any()
    _assert_all_equal(_every_rank(worlds, f"vocab/{name}"), want, name)


@pytest.mark.parametrize("i", range(len(dw.VOCAB_CASES)), ids=[c[0] for c in dw.VOCAB_CASES])
def test_vocab_parallel_logprob_gradient_shards_equal_the_reference_gradient(worlds, i):
    name, V, _ = dw.VOCAB_CASES[i]
    z, t, dy = dw.vocab_inputs(i)
    zg = z.clone().requires_grad_()
    token_logprobs(zg, t).backward(dy)
    for ws, ranks in worlds.items():
        got = torch.cat([res[f"vocab/{name}"]["grad"] for res in ranks], dim=-1)
        rep = dw.bit_report(got, zg.grad)
        assert rep["differing"] == 0, f"{name} TP={ws}: {rep}"


def test_all_reduce_vocab_logprob_does_not_give_the_reference_bits(worlds):
    """Negative control: per-rank sum-exp and target logit summed by all_reduce(SUM), as a stock
    vocabulary-parallel cross-entropy does; it must differ from the reference somewhere."""
    counts = {}
    for i, (name, V, _) in enumerate(dw.VOCAB_CASES):
        z, t, _ = dw.vocab_inputs(i)
        want = token_logprobs_reference(z, t)
        for ws in (2, 4):
            counts[f"{name} TP={ws}"] = dw.bit_report(worlds[ws][0][f"vocab/{name}"]["all_reduce"], want)["differing"]
    print(f"\nall_reduce(SUM) vocabulary-parallel logprobs differing from the reference: {counts}")
    if not any(counts.values()):
        pytest.skip(f"all_reduce(SUM) happened to give the reference bits for every row here: {counts}")
    assert any(counts.values())


def test_vocab_parallel_refuses_fewer_vocabulary_leaves_than_ranks(worlds):
    assert worlds[1][0]["refuse/vocab_3_leaves"] == "accepted"
    for res in worlds[2]:   # 3 leaves over 2 ranks: 1024 and 1976 columns, not the 1500 given
        assert "ValueError" in res["refuse/vocab_3_leaves"] and "1500" in res["refuse/vocab_3_leaves"]
    for res in worlds[4]:
        msg = res["refuse/vocab_3_leaves"]
        assert msg.startswith("ValueError") and "3 leaf" in msg and "tp=4" in msg, msg


# ------------------------------------------------------------- one process, no group; refusals

def test_one_process_without_a_group_runs_the_single_process_kernels_bit_for_bit():
    x, w, b, _ = dw.row_inputs(0)
    K, L = dw.ROW_CASES[0][1], dw.ROW_CASES[0][2]
    got = dw.row_parallel_linear(x, w, b, in_features=K, leaves=L)
    assert dw.bit_report(got, linear(x, w, b, leaves=L))["differing"] == 0
    x, w, b, _ = dw.col_inputs(1)
    assert dw.bit_report(dw.column_parallel_linear(x, w, b, out_features=w.shape[0]), linear(x, w, b))["differing"] == 0
    z, t, _ = dw.vocab_inputs(1)
    got = dw.vocab_parallel_token_logprobs(z, t, vocab_size=z.shape[-1])
    assert dw.bit_report(got, token_logprobs_reference(z, t))["differing"] == 0


@pytest.mark.parametrize("i", range(len(dw.ROW_CASES)), ids=[c[0] for c in dw.ROW_CASES])
def test_one_process_walk_of_the_leaves_equals_the_gathered_leaf_partials_bitwise(i):
    # at tp = 1 row_parallel_linear is the invariant linear's own L-leaf walk (one launch); the
    # tp > 1 arithmetic, leaf partials alone then added in leaf order, run in the same process
    x, w, b, _ = dw.row_inputs(i)
    K, L = dw.ROW_CASES[i][1], dw.ROW_CASES[i][2]
    walk = dw.row_parallel_linear(x, w, b, in_features=K, leaves=L)
    by_partials = row_parallel_linear_by_partials(x, w, b, in_features=K, leaves=L)
    assert dw.bit_report(walk, by_partials)["differing"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("K,N,L", [(2048, 1024, 4), (3072, 1024, 4), (4096, 4096, 2), (12288, 4096, 4)])
def test_row_parallel_linear_cuda_walk_equals_the_gathered_leaf_partials_bitwise(K, N, L):
    # the Triton walk (split-K programs at small M, the leaf loop of one program at large M, the
    # table's K tile) against each leaf's one-leaf fp32 GEMM added in leaf order
    g = torch.Generator().manual_seed(71)
    w = (torch.randn(N, K, generator=g) / K**0.5).bfloat16().cuda()
    b = torch.randn(N, generator=g).bfloat16().cuda()
    for m in (1, 16, 64, 256, 1000, 2048, 8192):
        x = torch.randn(m, K, generator=g).bfloat16().cuda()
        for bias in (None, b):
            walk = dw.row_parallel_linear(x, w, bias, in_features=K, leaves=L)
            by_partials = row_parallel_linear_by_partials(x, w, bias, in_features=K, leaves=L)
            rep = dw.bit_report(walk, by_partials)
            assert rep["differing"] == 0, (K, N, L, m, bias is not None, rep)


def _raises(call, *words, kind=ValueError):
    with pytest.raises(kind) as e:
        call()
    assert all(w in str(e.value) for w in words), str(e.value)


def test_wrong_shapes_raise_one_clear_error_naming_the_problem():
    x, w, b, _ = dw.row_inputs(0)          # K = 337, N = 24
    row = dw.row_parallel_linear
    _raises(lambda: row(x[..., :300], w, b, in_features=337, leaves=4), "[0, 337)", "(2, 5, 300)")
    _raises(lambda: row(x, w[:, :300], b, in_features=337, leaves=4), "[N, 337]", "(24, 300)")
    _raises(lambda: row(x, w, b[:5], in_features=337, leaves=4), "bias", "[24]", "(5,)")
    _raises(lambda: row(x, w, b, in_features=337, leaves=9), "L=9", "need 1 <= L <= 6")
    _raises(lambda: row(x, w.double(), b, in_features=337, leaves=4), "float64", kind=TypeError)
    col = dw.column_parallel_linear
    _raises(lambda: col(x, w, b, out_features=30), "30 rows", "(24, 337)")
    _raises(lambda: col(x, w, b[:3], out_features=24), "bias", "(3,)")
    _raises(lambda: col(x[..., :100], w, b, out_features=24), "(2, 5, 100)", "K is 337")
    z, t, _ = dw.vocab_inputs(0)           # V = 4396
    lp = dw.vocab_parallel_token_logprobs
    _raises(lambda: lp(z[..., :4000], t, vocab_size=4396), "[0, 4396)", "4000")
    _raises(lambda: lp(z, t[:, :3], vocab_size=4396), "32 logit rows", "(4, 3)")
    _raises(lambda: lp(z, t.float(), vocab_size=4396), "integer token id")
    _raises(lambda: lp(z, t + 4396, vocab_size=4396), "outside the vocabulary [0, 4396)")
