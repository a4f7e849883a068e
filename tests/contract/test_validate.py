from dataclasses import replace

from isoexec.contract import Case, check, validate, with_identities
from isoexec.errors import ContractInvalid

import pytest


def _msgs(c, req=None):
    return [str(v) for v in validate(c, req)]


def test_valid_contract_has_no_violations(dense_isoexec_cpu, dense_native_cpu):
    assert validate(dense_isoexec_cpu) == []
    assert validate(dense_native_cpu) == []


def test_validate_returns_every_violation_not_just_the_first(dense_isoexec_cpu):
    c = dense_isoexec_cpu
    e0 = next(e for e in c.composition if e.half == "function")
    comp = tuple(replace(e, discharge=None) if e is e0 else e for e in c.composition)
    bad = replace(c, composition=comp, cases=c.cases + (c.cases[0],))
    msgs = _msgs(bad)
    assert any("has no discharge" in m for m in msgs)
    assert any("duplicate case id" in m for m in msgs)
    assert any("$.identities.numerical_policy" in m for m in msgs)
    assert len(msgs) >= 3


def test_uncovered_op_in_some_case_is_a_violation(dense_isoexec_cpu):
    c = dense_isoexec_cpu
    comp = tuple(replace(e, cases=tuple(x for x in e.cases if x != "engine_decode")) if e.region == ("rope",) else e
                 for e in c.composition)
    msgs = _msgs(with_identities(replace(c, composition=comp)))
    assert msgs == ["$.composition: logical op 'rope' has no region in case 'engine_decode'"]


def test_op_in_two_regions_is_a_violation(dense_isoexec_cpu):
    c = dense_isoexec_cpu
    dup = next(e for e in c.composition if e.region == ("o_proj",))
    msgs = _msgs(with_identities(replace(c, composition=c.composition + (dup,))))
    assert any("'o_proj' is in 2 regions" in m for m in msgs)


def test_required_ops_catch_a_missing_model_op(dense_isoexec_cpu):
    c = dense_isoexec_cpu
    comp = tuple(e for e in c.composition if e.region != ("act",))
    msgs = _msgs(with_identities(replace(c, composition=comp)), frozenset({"act"} | {o for e in comp for o in
                                                                                     e.region}))
    assert any("model op 'act'" in m for m in msgs)


def test_undischarged_function_entry_only_allowed_without_zero_tolerance(dense_isoexec_cpu, dense_native_cpu):
    assert all(e.discharge is None for e in dense_native_cpu.composition)
    assert validate(dense_native_cpu) == []
    c = dense_isoexec_cpu
    comp = tuple(replace(e, discharge=None) for e in c.composition)
    msgs = _msgs(with_identities(replace(c, composition=comp)))
    assert sum("has no discharge" in m for m in msgs) == sum(e.half == "function" for e in comp)


def test_standard_case_roles_are_enforced(dense_isoexec_cpu):
    c = dense_isoexec_cpu
    cases = tuple(Case(x.id, "engine", x.grad, x.state, x.shape) if x.id == "trainer_fwd" else x for x in c.cases)
    msgs = _msgs(with_identities(replace(c, cases=cases)))
    assert any("standard case 'trainer_fwd' has role 'trainer'" in m for m in msgs)


def test_check_raises_with_all_violations(dense_isoexec_cpu):
    bad = replace(dense_isoexec_cpu, cases=dense_isoexec_cpu.cases + (dense_isoexec_cpu.cases[0],))
    with pytest.raises(ContractInvalid) as ei:
        check(bad)
    assert len(ei.value.violations) >= 2
