"""The ``variant`` topology kind and the native composition for tensor parallelism (``native_tp4``):
tp claimed over [1, 2, 4] with bits that depend on tp, native.yaml's stock entries, the row-parallel
regions without ``K_LEAVES`` (their sums all-reduced). What validation requires of a variant tp
claim: no K leaves pinned on the row-parallel regions, and no tolerance of 0 beside it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from isoexec.compose import build_contract
from isoexec.contract import K_LEAVES, TOPOLOGY_KINDS, decode, diff, encode
from isoexec.errors import ContractInvalid, IsoExecError
from isoexec.paths import resolve_config

TP4 = resolve_config("compositions", "isoexec_tp4").read_text()
NATIVE_TP4 = resolve_config("compositions", "native_tp4").read_text()


def _variant(tmp_path, text: str, *swaps: tuple[str, str]) -> str:
    for old, new in swaps:
        assert old in text, old
        text = text.replace(old, new)
    p = tmp_path / "variant.yaml"
    p.write_text(text)
    return str(p)


def test_variant_is_a_topology_kind():
    assert TOPOLOGY_KINDS == ("invariant", "pinned", "variant")


@pytest.mark.parametrize("family, model", [("dense", "dense_tp_tiny"), ("hybrid", "hybrid_tp_tiny"),
                                           ("dense", None), ("hybrid", None)])
@pytest.mark.parametrize("arch", ["cpu", "sm90"])
def test_native_tp4_is_native_with_a_variant_tp_claim(family, model, arch):
    c = build_contract(family, "native_tp4", arch, model)
    tp = c.topology_claim("tp")
    assert (tp.kind, sorted(tp.domain)) == ("variant", [1, 2, 4])
    assert not [e.region_name for e in c.composition if K_LEAVES in e.constants]
    assert not c.claims.tolerances
    native = build_contract(family, "native", arch, model)
    # the same regions, kernels and constants as native.yaml: only the tp claim differs
    assert {d.where for d in diff(native, c)} == {"claim topology tp"}, diff(native, c)
    assert native.identities.semantic == c.identities.semantic
    assert native.identities.numerical_policy != c.identities.numerical_policy
    back = decode(encode(c))   # the kind survives the canonical bytes
    assert encode(back) == encode(c) and back.topology_claim("tp").kind == "variant"


@pytest.mark.parametrize("family", ["mla_moe", "hybrid_moe"])
def test_native_tp4_covers_the_moe_families_with_native_entries_and_a_variant_tp_claim(family):
    tp4 = build_contract(family, "native_tp4", "cpu")
    native = build_contract(family, "native", "cpu")
    impls = lambda c: {tuple(sorted(e.region)): e.impl.id for e in c.composition if e.half == "function"}  # noqa: E731
    assert impls(tp4) == impls(native)   # native.yaml's stock kernels, the MoE regions among them
    assert {impls(tp4)[(o,)] for o in ("router", "dispatch", "experts", "combine")} == {
        "torch_moe_router", "torch_moe_dispatch", "torch_moe_experts", "torch_moe_combine"}
    tp = next(t for t in tp4.claims.topology if t.axis == "tp")
    assert (tp.kind, tp.domain) == ("variant", (1, 2, 4))


def test_the_cli_refuses_a_composition_for_a_family_it_does_not_cover_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "isoexec.cli", "contract", "build", "--family", "dense",
                        "--composition", "isoexec_ep4", "--arch", "cpu", "--out", str(tmp_path / "c.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "does not cover the dense family" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "c.json").exists()


def test_a_variant_tp_claim_pins_no_k_leaves_on_the_row_parallel_regions(tmp_path):
    """isoexec_tp4 with its tp claim made variant (and its zero tolerances dropped): the 4 leaves it
    pins would promise a fixed order of the sums that a variant claim has them all-reduce instead."""
    path = _variant(tmp_path, TP4, ("kind: invariant", "kind: variant"),
                    ("  tolerances:\n" + "".join(line + "\n" for line in TP4.split("  tolerances:\n")[1]
                                                 .split("\n")[:3]), ""))
    with pytest.raises(ContractInvalid) as exc:
        build_contract("dense", path, "cpu", "dense_tp_tiny")
    msg = str(exc.value)
    for region in ("'o_proj'", "'down_proj'"):
        assert f"row-parallel region {region} pins K_LEAVES=4, a fixed leaf order" in msg, msg
    assert "tolerance of 0" not in msg


def test_a_variant_tp_claim_and_a_zero_tolerance_exclude_each_other(tmp_path):
    """isoexec_tp4 with its tp claim variant and its K leaves unpinned keeps its tolerances of 0,
    which a trainer at tp 1 and an engine at tp 2 whose bits differ cannot keep."""
    path = _variant(tmp_path, TP4, ("kind: invariant", "kind: variant"), (", K_LEAVES: 4}", "}"))
    with pytest.raises(ContractInvalid) as exc:
        build_contract("dense", path, "cpu", "dense_tp_tiny")
    msg = str(exc.value)
    assert "axis 'tp' is claimed variant (its bits depend on its size) beside a tolerance of 0" in msg, msg
    assert "K_LEAVES" not in msg


def test_an_invariant_tp_claim_still_needs_k_leaves_on_the_stock_linear(tmp_path):
    """native_tp4 claiming tp invariant: its torch_linear row-parallel regions pin no K leaves, so
    nothing fixes the order of their cross-rank sums."""
    path = _variant(tmp_path, NATIVE_TP4, ("kind: variant", "kind: invariant"))
    with pytest.raises(ContractInvalid, match="row-parallel region 'o_proj' \\(impl torch_linear\\) pins no K_LEAVES"):
        build_contract("dense", path, "cpu", "dense_tp_tiny")


def test_an_unknown_topology_kind_is_refused(tmp_path):
    with pytest.raises(IsoExecError, match="variable"):
        build_contract("dense", _variant(tmp_path, NATIVE_TP4, ("kind: variant", "kind: variable")), "cpu")
