"""The FSDP2 trainer gathers one decoder layer at a time (isoexec/dist/fsdp/shard.py), measured on
its own model at dp = 2 (gloo, CPU) by a probe at every layer's entry (fsdp_layer_workers.py):

- in a forward, with a graph or without (scoring), only the running layer is gathered, and every
  other layer's gathered tensors hold no storage;
- in the backward each layer is gathered again (with the one before it, FSDP2's prefetch), and the
  layers behind it are freed with their unsharded gradients; with activation checkpointing the
  recompute runs inside the gathered layer; after the backward nothing is gathered and every shard
  has its reduced gradient;
- what is gathered at once never exceeds the memory plan's figure (``FsdpUnits``: the root and two
  layers), and reaches it;
- the bits do not move: scoring and the training forward are the one-process bits, a run of
  several micro-batches per rank with activation checkpointing is bitwise the same run to run and
  the same as without it.

A layer loop that gathered every layer at the model's entry and kept them until the backward's end
fails the first two tests at its first probe."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import fsdp_layer_workers as lw  # noqa: E402
import fsdp_workers as fw  # noqa: E402
from dist_workers import bit_report  # noqa: E402
from isoexec.plan.states import GATHERED_LAYERS, fsdp_units  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

KEYS = [f"{f}/{d}/{'ac' if c else 'plain'}" for f, d, c in lw.CASES]


@pytest.fixture(scope="module")
def job(fsdp_job):
    return fsdp_job


@pytest.fixture(scope="module")
def world(fsdp_layer_worlds):
    return fsdp_layer_worlds


def _layers(ev) -> set:
    return {u for u, g in ev["gathered"].items() if g and u != "root"}


def _assert_freed_but(ev, keep: set, what: str) -> None:
    """Every layer outside ``keep`` is sharded and its gathered tensors hold no storage."""
    for u, held in ev["bytes"].items():
        if u != "root" and u not in keep:
            assert not ev["gathered"][u] and held == 0, f"{what}: layer {u} still holds {held} bytes"


@pytest.mark.parametrize("key", KEYS)
def test_each_layer_is_freed_after_its_forward_and_gathered_again_for_its_backward(world, key):
    checkpointing = key.endswith("/ac")
    for rank, res in enumerate(world):
        r = res[key]
        assert r["refilled"], "FSDP2 gathered into new tensors: the storage counts would miss them"
        events = r["train_events"]
        n = len([u for u in events[0]["gathered"] if u != "root"])
        fwd = [e for e in events if e["phase"] == "forward"]
        assert [e["layer"] for e in fwd] == list(range(n))
        for e in fwd:
            what = f"{key} rank {rank}, forward of layer {e['layer']}"
            assert _layers(e) == {e["layer"]} and e["gathered"]["root"], what
            assert e["bytes"][e["layer"]] >= r["unit_bytes"][e["layer"]], what
            _assert_freed_but(e, {e["layer"]}, what)
        after_fwd = next(e for e in events if e["phase"] == "after_forward")
        assert _layers(after_fwd) == set() and after_fwd["gathered"]["root"]
        _assert_freed_but(after_fwd, set(), f"{key} rank {rank}, after the forward")
        bwd = [e for e in events if e["phase"] == "backward"]
        assert [e["layer"] for e in bwd] == list(reversed(range(n)))
        for e in bwd:
            k, what = e["layer"], f"{key} rank {rank}, backward of layer {e['layer']}"
            assert k in _layers(e) and _layers(e) <= {k, k - 1}, what
            assert e["bytes"][k] >= r["unit_bytes"][k], what
            _assert_freed_but(e, {k, k - 1}, what)
            # the layers behind it have reduce-scattered their gradients and dropped the unsharded ones
            assert all(e["grad_bytes"][j] == 0 for j in range(k + 1, n)), what
        rec = [e for e in events if e["phase"] == "recompute"]
        assert [e["layer"] for e in rec] == (list(reversed(range(n))) if checkpointing else [])
        for e in rec:   # the recompute runs inside the layer gathered again, the layers behind it freed
            k = e["layer"]
            assert k in _layers(e) and _layers(e) <= {k, k - 1}, f"{key} rank {rank}, recompute of layer {k}"
        end = events[-1]
        assert end["phase"] == "after_backward" and not any(end["gathered"].values())
        assert all(b == 0 for b in end["bytes"].values()) and all(b == 0 for b in end["grad_bytes"].values())
        assert set(r["grads"].values()) == {"DTensor"}, "every shard holds its reduced gradient"


def _one_process_scores(job, family: str, dt: str, config: str):
    """The family's model and the single-process Trainer's scores of the scoring batch."""
    model = fw.build_model(job, family, fw.DTYPES[dt])
    return model, fw.Trainer(model, fw.config(config)).score(*fw.score_batch())


@pytest.mark.parametrize("key", KEYS)
def test_scoring_stays_bitwise_the_one_process_bits_with_per_layer_resharding(world, job, key):
    """Scoring (no graph) frees each layer after its forward too, and its logprobs and those of the
    training forward are the single-process Trainer's bits."""
    family, dt, _ = key.split("/")
    model, want = _one_process_scores(job, family, dt, "A")
    for rank, res in enumerate(world):
        r = res[key]
        for e in r["score_events"]:
            assert e["phase"] == "forward" and _layers(e) == {e["layer"]}, f"{key} rank {rank}"
            _assert_freed_but(e, {e["layer"]}, f"{key} rank {rank}, scoring")
        assert sum(bit_report(g, w)["differing"] for g, w in zip(r["score"], want)) == 0, f"{key} rank {rank}"
        share = range(rank * fw.N_SEQ // lw.WORLD, (rank + 1) * fw.N_SEQ // lw.WORLD)
        packed = fw.PackedSequences.from_lists([fw.train_batch(0).sequences[i] for i in share])
        fwd = fw.score_logprobs(model, packed, grad=True).detach()
        assert bit_report(r["fwd"], fwd)["differing"] == 0, f"{key} rank {rank}"


@pytest.mark.parametrize("key", KEYS)
def test_what_is_gathered_at_once_is_what_the_memory_plan_counts(world, job, key):
    """The plan's trainer weights under FSDP2 (isoexec/plan/states.py): the root and two layers in
    the compute dtype, the second the layer FSDP2 prefetches in the backward (on the CPU its
    all-gather is issued at the pre-backward of the layer after it and copied out when its own
    backward starts, so at a probe it is gathered or in flight). The largest sum over the probes
    stays within the plan's figure; where the layers are all of one size (dense) the backward
    reaches it."""
    family, dt, _ = key.split("/")
    units = fsdp_units(family, job["cfgs"][family])
    planned = units.gathered_bytes({"fp32": "float32", "bf16": "bfloat16"}[dt])
    for rank, res in enumerate(world):
        r = res[key]
        peak = 0
        for e in r["train_events"] + r["score_events"]:
            held = {u for u, g in e["gathered"].items() if g} | {u for u, f in e["prefetched"].items() if f}
            assert len(held - {"root"}) <= GATHERED_LAYERS
            peak = max(peak, sum(r["unit_bytes"][u] for u in held))
            if e["phase"] == "backward" and e["layer"] > 0:   # the layer before it: prefetched
                assert e["layer"] - 1 in held, f"{key} rank {rank}, backward of layer {e['layer']}"
        assert peak <= planned, f"{key} rank {rank}: {peak} bytes gathered, the plan counts {planned}"
        if family == "dense":
            assert peak == planned


def _differing(got: dict, want: dict) -> int:
    assert got.keys() == want.keys()
    return sum(bit_report(got[n], want[n])["differing"] for n in want)


def test_training_with_per_layer_resharding_is_bitwise_run_to_run(world):
    """Run C of the hybrid model (one sequence per micro-batch: two micro-batches per rank and
    mini-batch, each reduce-scattered and added into the shards' gradients) with activation
    checkpointing, twice: the same bits, on every rank."""
    for rank, res in enumerate(world):
        a, b = res["runs"]["C_ac"], res["runs"]["C_ac_again"]
        assert _differing(a["params"], b["params"]) == 0 and a["stats"] == b["stats"], rank
        assert _differing(a["params"], world[0]["runs"]["C_ac"]["params"]) == 0, "ranks disagree"


def test_activation_checkpointing_inside_the_layer_units_leaves_the_same_weights(world):
    """The recompute reads the layer gathered again, the bits of its forward: run C with and
    without activation checkpointing gives the same weights and statistics."""
    for rank, res in enumerate(world):
        a, b = res["runs"]["C_ac"], res["runs"]["C"]
        assert _differing(a["params"], b["params"]) == 0, rank
        assert a["stats"] == b["stats"], rank


# ------------------------------------------------------------- reshard_after_forward=False
KEPT_KEYS = [f"kept/{f}/{d}" for f, d in lw.KEPT_CASES]


@pytest.mark.parametrize("key", KEPT_KEYS)
def test_kept_layers_stay_gathered_from_their_forward_to_their_backward(world, key):
    """``reshard_after_forward=False``: at layer k's forward every layer before it is still
    gathered; after the forward all are; in the backward layer k is gathered (no second gather:
    it never left) while the layers behind it are freed with their unsharded gradients; after the
    backward nothing is gathered and every shard holds its reduced gradient."""
    for rank, res in enumerate(world):
        r = res[key]
        assert r["refilled"]
        events = r["train_events"]
        n = len([u for u in events[0]["gathered"] if u != "root"])
        fwd = [e for e in events if e["phase"] == "forward"]
        assert [e["layer"] for e in fwd] == list(range(n))
        for e in fwd:
            assert set(range(e["layer"] + 1)) <= _layers(e), f"{key} rank {rank}, forward of layer {e['layer']}"
        after_fwd = next(e for e in events if e["phase"] == "after_forward")
        assert _layers(after_fwd) == set(range(n)) and after_fwd["gathered"]["root"]
        bwd = [e for e in events if e["phase"] == "backward"]
        assert [e["layer"] for e in bwd] == list(reversed(range(n)))
        for e in bwd:
            k, what = e["layer"], f"{key} rank {rank}, backward of layer {e['layer']}"
            assert _layers(e) == set(range(k + 1)), what
            assert all(e["bytes"][j] == 0 and e["grad_bytes"][j] == 0 for j in range(k + 1, n)), what
        end = events[-1]
        assert end["phase"] == "after_backward" and not any(end["gathered"].values())
        assert all(b == 0 for b in end["bytes"].values()) and all(b == 0 for b in end["grad_bytes"].values())
        assert set(r["grads"].values()) == {"DTensor"}


@pytest.mark.parametrize("key", KEPT_KEYS)
def test_kept_layers_gather_once_per_scoring_pass_and_score_the_one_process_bits(world, job, key):
    """Scoring in several micro-batches: the first micro-batch gathers the layers one by one and
    keeps them, the later ones find every layer gathered; the logprobs are the single-process
    Trainer's bits."""
    _, family, dt = key.split("/")
    _, want = _one_process_scores(job, family, dt, "C")
    for rank, res in enumerate(world):
        r = res[key]
        events = r["score_events"]
        n = len([u for u in events[0]["gathered"] if u != "root"])
        assert len(events) >= 2 * n, f"{key} rank {rank}: fewer than two scoring micro-batches"
        for i, e in enumerate(events):
            need = set(range(e["layer"] + 1)) if i < n else set(range(n))
            assert need <= _layers(e), f"{key} rank {rank}, scoring event {i} (layer {e['layer']})"
        assert sum(bit_report(g, w)["differing"] for g, w in zip(r["score"], want)) == 0, f"{key} rank {rank}"


@pytest.mark.parametrize("key", KEPT_KEYS)
def test_kept_layers_are_what_the_memory_plan_counts(world, job, key):
    """With the layers kept the plan counts the root and every layer in the compute dtype; the
    largest sum over the probes stays within it and, after the forward, reaches it."""
    _, family, dt = key.split("/")
    units = fsdp_units(family, job["cfgs"][family], reshard_after_forward=False)
    planned = units.gathered_bytes({"fp32": "float32", "bf16": "bfloat16"}[dt])
    freed = fsdp_units(family, job["cfgs"][family]).gathered_bytes({"fp32": "float32", "bf16": "bfloat16"}[dt])
    assert planned >= freed and (planned > freed) == (units.layers > GATHERED_LAYERS * units.layer)
    for rank, res in enumerate(world):
        r = res[key]
        peak = max(sum(r["unit_bytes"][u] for u, g in e["gathered"].items() if g)
                   for e in r["train_events"] + r["score_events"])
        assert peak == planned, f"{key} rank {rank}: {peak} bytes gathered, the plan counts {planned}"


@pytest.mark.parametrize("ckpt", ["C_kept", "C_ac_kept"])
def test_keeping_layers_gathered_leaves_the_same_weights(world, ckpt):
    """Run C (two micro-batches per rank and mini-batch, gradient clipping) with the layers kept
    from forward to backward, with and without activation checkpointing: the weights and
    statistics of the run that frees them after the forward, bit for bit."""
    for rank, res in enumerate(world):
        a, b = res["runs"][ckpt], res["runs"]["C"]
        assert _differing(a["params"], b["params"]) == 0, rank
        assert a["stats"] == b["stats"], rank
