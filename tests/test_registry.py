"""The registry collects the implementations each kernel folder declares (isoexec_kernels/impl.py),
and binding takes the declared callables with their constants."""

import pkgutil
from dataclasses import replace

import pytest

import isoexec_kernels
from isoexec import registry
from isoexec.enforce import bind
from isoexec.errors import BindingRefused
from isoexec_kernels.impl import Constant, Impl, per_case


def test_every_op_folder_s_impls_are_collected():
    declared = []
    for info in pkgutil.iter_modules(isoexec_kernels.__path__):
        if info.ispkg:
            declared += getattr(__import__(f"isoexec_kernels.{info.name}", fromlist=["IMPLS"]), "IMPLS", ())
    assert declared and all(i in registry.IMPLS for i in declared)
    assert {i.id for i in registry.IMPLS} - {i.id for i in declared} == {"paged_kv"}   # deployment, not a kernel


def test_every_function_kind_of_the_covered_families_has_an_invariant_and_a_stock_impl():
    for fam in ("dense", "hybrid", "mla_moe"):
        kinds = {registry.OPS[o].kind for o in registry.FAMILIES[fam].ops} - {"deployment"}
        for kind in kinds:
            impls = [i for i in registry.IMPLS if i.kind == kind]
            assert any(i.native for i in impls) and any(not i.native for i in impls), kind


def test_impls_hold_real_callables_of_their_folder():
    spec = registry.impl("rmsnorm_fixed", "cpu")
    fn = registry.entry_for(spec, "engine_decode")
    assert callable(fn) and fn.__module__ == "isoexec_kernels.rmsnorm.api"
    core = registry.impl("gdn_cpr", "sm90")
    assert registry.entry_for(core, "engine_prefill").__name__ == "gdn_cpr_engine"


def test_a_record_is_checked_when_it_is_declared():
    with pytest.raises(ValueError, match="must reach the kernel"):
        Impl("x", "1", "norm", len, constants={"TILE": Constant(64, (32, 64))})
    with pytest.raises(ValueError, match="unknown case"):
        Impl("x", "1", "norm", {"trainer_bwd": len})
    with pytest.raises(ValueError, match="not among the allowed"):
        Constant(3, (1, 2))
    assert per_case(len, abs, max)["trainer_score"] is len


def test_a_pinned_constant_the_kernel_does_not_run_with_is_refused(dense_isoexec_cpu):
    e = next(x for x in dense_isoexec_cpu.composition if x.region == ("lm_head",))
    bind(e, "engine_decode")
    bad = replace(e, constants={**e.constants, "BLOCK_K": 32})   # allowed by the registry, not built
    with pytest.raises(BindingRefused, match="runs with BLOCK_K=64"):
        bind(bad, "engine_decode")


def test_model_ops_drop_only_whole_optional_groups():
    """A dense model may lack its q/k norm (qwen2), both ops together, and nothing else."""
    from isoexec.errors import CompositionError

    full = registry.FAMILIES["dense"].ops
    assert registry.model_ops("dense") == full
    assert set(full) - set(registry.model_ops("dense", ("k_norm", "q_norm"))) == {"q_norm", "k_norm"}
    for bad in (("q_norm",), ("k_norm", "q_norm", "o_proj")):
        with pytest.raises(CompositionError, match="only whole optional groups may be absent .*q_norm\\+k_norm"):
            registry.model_ops("dense", bad)
    with pytest.raises(CompositionError, match="\\(the family's: none\\)"):
        registry.model_ops("hybrid", ("q_norm", "k_norm"))
