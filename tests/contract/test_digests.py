"""Each identity rotates on exactly the fields docs/contract.md names, and on no others."""

from dataclasses import replace

import pytest

from isoexec.contract import (
    Bounds,
    Case,
    Discharge,
    ImplRef,
    StateClaim,
    TopologyClaim,
    ToleranceClaim,
    compute_identities,
    frozen_mapping,
)
from isoexec.contract.digests import numerical_policy_digest


def _fn_entry_index(c):
    return next(i for i, e in enumerate(c.composition) if e.half == "function" and e.constants)


def _dep_entry_index(c):
    return next(i for i, e in enumerate(c.composition) if e.half == "deployment")


def _replace_entry(c, i, **kw):
    comp = list(c.composition)
    comp[i] = replace(comp[i], **kw)
    return replace(c, composition=tuple(comp))


def _with_case(c, i, **kw):
    cases = list(c.cases)
    cases[i] = replace(cases[i], **kw)
    return replace(c, cases=tuple(cases))


MUTATIONS = {
    # name: (mutation, identities expected to rotate)
    "model.family": (lambda c: replace(c, model=replace(c.model, family="other")), {"semantic"}),
    "model.config_digest": (lambda c: replace(c, model=replace(c.model, config_digest="1" * 64)), {"semantic"}),
    "model.architectures": (lambda c: replace(c, model=replace(c.model, architectures=("X",))), {"semantic"}),
    "case.shape": (lambda c: _with_case(c, 0, shape="static" if c.cases[0].shape == "variable" else "variable"),
                   {"semantic"}),
    "case.role": (lambda c: _with_case(c, 0, role="engine" if c.cases[0].role == "trainer" else "trainer"), set()),
    "case.grad": (lambda c: _with_case(c, 0, grad=not c.cases[0].grad), set()),
    "case.state": (lambda c: _with_case(c, 0, state="resumable"), set()),
    "function.impl.version": (lambda c: _replace_entry(c, _fn_entry_index(c), impl=replace(
        c.composition[_fn_entry_index(c)].impl, version="99")), {"numerical_policy"}),
    "function.impl.id": (lambda c: _replace_entry(c, _fn_entry_index(c), impl=replace(
        c.composition[_fn_entry_index(c)].impl, id="other")), {"numerical_policy"}),
    "function.constants": (lambda c: _replace_entry(c, _fn_entry_index(c), constants=frozen_mapping(
        {**c.composition[_fn_entry_index(c)].constants, "NEW": 7})), {"numerical_policy"}),
    "function.discharge": (lambda c: _replace_entry(c, _fn_entry_index(c), discharge=Discharge("gate", "abc")),
                           {"numerical_policy"}),
    "function.cases": (lambda c: _replace_entry(c, _fn_entry_index(c), cases=("trainer_fwd",)),
                       {"numerical_policy"}),
    "function.region_refused": (lambda c: _replace_entry(c, _fn_entry_index(c), region=(
        *c.composition[_fn_entry_index(c)].region, "extra_op")), {"numerical_policy", "semantic"}),
    "deployment.constants": (lambda c: _replace_entry(c, _dep_entry_index(c), constants=frozen_mapping(
        {"PAGE_SIZE": 32})), {"deployment"}),
    "deployment.impl": (lambda c: _replace_entry(c, _dep_entry_index(c), impl=ImplRef("x", "2", "cpu")),
                        {"deployment"}),
    "half.move": (lambda c: _replace_entry(c, _fn_entry_index(c), half="deployment"),
                  {"numerical_policy", "deployment"}),
    "claims.topology": (lambda c: replace(c, claims=replace(c.claims, topology=c.claims.topology + (
        TopologyClaim("tp", "invariant", (1, 2), "gate:x"),))), {"numerical_policy"}),
    "claims.state": (lambda c: replace(c, claims=replace(c.claims, state=(StateClaim("s", ("ev",)),))),
                     {"deployment"}),
    "claims.tolerances": (lambda c: replace(c, claims=replace(c.claims, tolerances=(
        ToleranceClaim(("trainer_fwd", "engine_decode"), Bounds("1e-6", "1e-3")),))), {"deployment"}),
    "cases.add": (lambda c: replace(c, cases=c.cases + (Case("extra", "engine", False, "fresh", "static"),)),
                  {"semantic", "numerical_policy"}),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_digest_rotates_on_exactly_its_fields(dense_isoexec_cpu, name):
    mutate, expected = MUTATIONS[name]
    before = compute_identities(dense_isoexec_cpu)
    after = compute_identities(mutate(dense_isoexec_cpu))
    rotated = {k for k in ("semantic", "numerical_policy", "deployment") if getattr(before, k) != getattr(after, k)}
    assert rotated == expected


def test_schema_version_rotates_numerical_policy_only(dense_isoexec_cpu):
    before = compute_identities(dense_isoexec_cpu)
    c = replace(dense_isoexec_cpu, schema_version="2")
    assert numerical_policy_digest(c) != before.numerical_policy
    after = compute_identities(c)
    assert (after.semantic, after.deployment) == (before.semantic, before.deployment)


def test_reordering_entries_cases_and_claims_rotates_nothing(dense_isoexec_cpu):
    c = dense_isoexec_cpu
    shuffled = replace(
        c,
        cases=tuple(reversed(c.cases)),
        composition=tuple(replace(e, cases=tuple(reversed(e.cases)), region=tuple(reversed(e.region)))
                          for e in reversed(c.composition)),
        claims=replace(c.claims, topology=tuple(reversed(c.claims.topology)),
                       tolerances=tuple(replace(t, cases=tuple(reversed(t.cases)))
                                        for t in reversed(c.claims.tolerances))),
    )
    assert compute_identities(shuffled) == compute_identities(c)


def test_refusing_ops_into_different_regions_keeps_semantic(dense_isoexec_cpu):
    c = dense_isoexec_cpu
    i = next(i for i, e in enumerate(c.composition) if len(e.region) == 3)
    fused = c.composition[i]
    split = tuple(replace(fused, region=(op,)) for op in fused.region)
    c2 = replace(c, composition=c.composition[:i] + split + c.composition[i + 1:])
    a, b = compute_identities(c), compute_identities(c2)
    assert a.semantic == b.semantic
    assert a.numerical_policy != b.numerical_policy
