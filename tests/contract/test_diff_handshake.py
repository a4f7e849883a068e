import logging
from dataclasses import replace

import pytest

from isoexec.contract import (diff, encode, frozen_mapping, handshake, offer, policy_differences, receive,
                              with_identities)
from isoexec.errors import ContractMismatch


def _bump(c, region, **constants):
    comp = tuple(replace(e, constants=frozen_mapping({**e.constants, **constants})) if e.region == region else e
                 for e in c.composition)
    return with_identities(replace(c, composition=comp))


def test_identical_contracts_have_no_differences(dense_isoexec_cpu):
    assert diff(dense_isoexec_cpu, dense_isoexec_cpu) == []


def test_diff_names_each_region_and_case(dense_isoexec_cpu):
    b = _bump(dense_isoexec_cpu, ("down_proj",), BLOCK_K=128)
    ds = policy_differences(dense_isoexec_cpu, b)
    assert {d.where for d in ds} == {f"region down_proj, case {c}" for c in dense_isoexec_cpu.case_ids}
    assert all(d.field == "constants.BLOCK_K" and (d.a, d.b) == (64, 128) for d in ds)
    assert "region down_proj, case engine_decode: constants.BLOCK_K 64 vs 128" in {str(d) for d in ds}


def test_diff_lists_native_vs_isoexec_impls(dense_isoexec_cpu, dense_native_cpu):
    ds = diff(dense_isoexec_cpu, dense_native_cpu)
    assert any(d.where == "region lm_head, case engine_decode" and d.field == "impl.id"
               and (d.a, d.b) == ("gemm_fixed_k", "torch_linear") for d in ds)
    assert any(d.where == "claim tolerance trainer_score/engine_decode" or "tolerance" in d.where for d in ds)


def test_handshake_accepts_the_same_contract(dense_isoexec_cpu):
    r = receive(dense_isoexec_cpu, offer(dense_isoexec_cpu))
    assert r.accepted and not r.overridden
    assert handshake(dense_isoexec_cpu, dense_isoexec_cpu).accepted


def test_handshake_refuses_policy_change_and_shows_region_case(dense_isoexec_cpu):
    engine = _bump(dense_isoexec_cpu, ("lm_head",), BLOCK_K=32)
    with pytest.raises(ContractMismatch) as ei:
        receive(dense_isoexec_cpu, offer(engine), local_name="trainer", remote_name="engine")
    msg = str(ei.value)
    assert "handshake refused" in msg
    assert "region lm_head, case engine_decode: constants.BLOCK_K 64 vs 32" in msg
    assert len(ei.value.differences) == len(dense_isoexec_cpu.case_ids)


def test_handshake_logs_but_allows_deployment_difference(dense_isoexec_cpu, caplog):
    other = _bump(dense_isoexec_cpu, ("kv_pages",), PAGE_SIZE=32)
    assert other.identities.numerical_policy == dense_isoexec_cpu.identities.numerical_policy
    assert other.identities.deployment != dense_isoexec_cpu.identities.deployment
    with caplog.at_level(logging.INFO, logger="isoexec.handshake"):
        r = receive(dense_isoexec_cpu, offer(other))
    assert r.accepted and len(r.deployment_differences) == len(dense_isoexec_cpu.case_ids)
    assert "deployment-only differences" in caplog.text


def test_override_is_explicit_and_recorded(dense_isoexec_cpu):
    engine = _bump(dense_isoexec_cpu, ("lm_head",), BLOCK_K=32)
    r = receive(dense_isoexec_cpu, offer(engine), allow_policy_mismatch=True)
    meta = r.metadata()
    assert meta["policy_override"] is True and meta["policy_differences"]


def test_handshake_refuses_a_tampered_contract(dense_isoexec_cpu):
    from isoexec.errors import ContractInvalid

    data = encode(dense_isoexec_cpu).replace(b'"BLOCK_K":64', b'"BLOCK_K":65', 1)
    with pytest.raises(ContractInvalid, match="does not match content"):
        receive(dense_isoexec_cpu, data)
