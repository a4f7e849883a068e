"""CPR version 4 (isoexec_kernels/gdn_core/cpr_chunk.py, work in progress): every output from the
chunk form on the native WY kernels. Under the Triton interpreter: the trainer's rows equal the
engine's, prefill split anywhere and decode token by token interleaved, bitwise, and they are the
function (tolerance against the float64 recurrence); a slot reset starts a sequence over."""

from __future__ import annotations

import pytest
import torch

from gdn_inputs import make_inputs
from isoexec_kernels.gdn_core import GDNState
from isoexec_kernels.gdn_core.chunk_form import torch_recurrence
from test_gdn_core import random_plan, run_engine


def _cpr4():
    from isoexec_kernels.gdn_core import cpr_chunk

    return cpr_chunk


def interp_case_cpr4_trainer_engine_split_and_decode_give_the_same_bits(kb):
    C4 = _cpr4()
    # C = 16: decode across two chunk boundaries; C = 64: pieces off the grid, a few decode steps
    # (the interpreter runs every decode step's four kernels over all lanes: minutes, not seconds)
    for C, lens, seed, max_decode in ((16, [40, 5, 33], 30, 24), (64, [70, 3, 66], 31, 4)):
        inp = make_inputs(lens, Hk=1, H=2, Dk=16, Dv=16, seed=seed, v_dtype=torch.bfloat16)
        trainer = C4.cpr4_varlen_triton(*inp, chunk=C)
        want = torch_recurrence(*(x.double() for x in inp[:5]), inp[5])
        assert kb.rel_l2(trainer, want) < 3e-2, "bf16 operands (truncated by the interpreter)"
        st = GDNState.allocate(len(lens) + 2, 2, 16, 16, "cpu", chunk=C, with_q=True)
        plan = random_plan(lens, seed, max_decode=max_decode)
        assert sum(kind == "decode" for kind, _ in plan) >= 3, "the plan must decode"
        slots = list(range(len(lens) + 1, 0, -1))[:len(lens)]
        o = run_engine(inp, lens, plan, slots, st, C4.cpr4_engine_triton, C4.cpr4_decode_triton, C)
        kb.assert_bitwise(o, trainer, f"engine split + decode == trainer, C={C}")


def interp_case_cpr4_decode_from_scratch_after_a_reset_repeats_its_bits(kb):
    C4 = _cpr4()
    C = 16
    lens = [37]
    inp = make_inputs(lens, Hk=1, H=2, Dk=16, Dv=16, seed=33, v_dtype=torch.bfloat16)
    st = GDNState.allocate(2, 2, 16, 16, "cpu", chunk=C, with_q=True)
    plan = [("prefill", {0: 3})] + [("decode", [0])] * 34
    first = run_engine(inp, lens, plan, [1], st, C4.cpr4_engine_triton, C4.cpr4_decode_triton, C)
    st.reset_(torch.tensor([1]))
    assert int(st.fill[1]) == 0 and not st.boundary[1].any() and not st.buf_q[1].any()
    again = run_engine(inp, lens, plan, [1], st, C4.cpr4_engine_triton, C4.cpr4_decode_triton, C)
    kb.assert_bitwise(again, first, "the same sequence again after a slot reset")


@pytest.mark.parametrize("case", sorted(n for n in list(globals()) if n.startswith("interp_case_")))
def test_gdn_cpr4_under_interpreter(interp_results, kb, case):
    kb.check_interp(interp_results, "test_gdn_cpr4", case)
