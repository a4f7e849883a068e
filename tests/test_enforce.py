"""Run-time enforcement: binding records, refusals on difference, topology checks."""

from dataclasses import replace

import pytest

from isoexec.enforce import BoundRecord, RuntimeFacts, bind, check_bindings, check_topology
from isoexec.errors import BindingRefused, TopologyRefused


def _entry(c, region):
    return next(e for e in c.composition if e.region == region)


def test_bind_records_what_was_bound(dense_native_cpu):
    b = bind(_entry(dense_native_cpu, ("lm_head",)), "engine_decode")
    r = b.record
    assert (r.module, r.qualname) == ("isoexec_kernels.gemm.native", "linear_native")
    assert (r.impl_id, r.impl_arch) == ("torch_linear", "cpu")
    check_bindings(dense_native_cpu, [r])


def test_a_patched_kernel_is_refused(dense_native_cpu, monkeypatch):
    import isoexec_kernels.gemm.native as native

    def impostor(x, w, bias=None):
        return x @ w.T

    monkeypatch.setattr(native, "linear_native", impostor)
    with pytest.raises(BindingRefused, match="patched"):
        bind(_entry(dense_native_cpu, ("lm_head",)), "engine_decode")


def test_a_record_differing_from_the_contract_is_refused(dense_native_cpu):
    r = bind(_entry(dense_native_cpu, ("lm_head",)), "engine_decode").record
    bad = BoundRecord(r.region, r.case, r.module, r.qualname, "torch_linear", "2", "cpu", r.constants)
    with pytest.raises(BindingRefused, match="bound impl torch_linear v2"):
        check_bindings(dense_native_cpu, [bad])
    other = BoundRecord(r.region, r.case, "some.module", "fast_linear", r.impl_id, r.impl_version, r.impl_arch,
                        r.constants)
    with pytest.raises(BindingRefused, match="some.module.fast_linear"):
        check_bindings(dense_native_cpu, [other])
    consts = BoundRecord(r.region, r.case, r.module, r.qualname, r.impl_id, r.impl_version, r.impl_arch, {"X": 1})
    with pytest.raises(BindingRefused, match="bound constants"):
        check_bindings(dense_native_cpu, [consts])


def test_bind_refuses_case_outside_entry(dense_native_cpu):
    e = replace(_entry(dense_native_cpu, ("lm_head",)), cases=("trainer_fwd",))
    with pytest.raises(BindingRefused, match="does not cover this case"):
        bind(e, "engine_decode")


def test_topology_accepts_proven_sizes(dense_isoexec_cpu):
    check_topology(dense_isoexec_cpu, RuntimeFacts(arch="cpu"))


@pytest.mark.parametrize("facts, words", [
    (RuntimeFacts(arch="cpu", tp=2), "tp=2 is not in the proven domain [1]"),
    (RuntimeFacts(arch="cpu", dp=4), "dp=4 is not in the proven domain [1]"),
    (RuntimeFacts(arch="sm90"), "runtime arch 'sm90'"),
])
def test_topology_refuses_unproven_sizes(dense_isoexec_cpu, facts, words):
    with pytest.raises(TopologyRefused, match=words.replace("[", r"\[").replace("]", r"\]")):
        check_topology(dense_isoexec_cpu, facts)


def test_topology_without_claim_allows_only_one(dense_isoexec_cpu):
    c = replace(dense_isoexec_cpu, claims=replace(dense_isoexec_cpu.claims, topology=()))
    with pytest.raises(TopologyRefused, match="makes no ep claim"):
        check_topology(c, RuntimeFacts(arch="cpu", ep=2))
