"""CPR version 4 (isoexec_kernels/gdn_core/cpr_chunk.py, its decode by rows cpr_row_decode.py and the
reference twin cpr_chunk_reference.py, work in progress): every output from the chunk form on the
native WY kernels. On the CPU, the
reference: trainer == engine prefill split anywhere == decode, bitwise, and the function at bf16
tolerance. Under the Triton interpreter, the kernels: the same equalities, a slot reset starts a
sequence over, and the kernels agree with the reference twin (at tolerance: the interpreter's bf16
cast truncates, so the twin is run with truncation too)."""

from __future__ import annotations

import pytest
import torch

from gdn_inputs import make_inputs
from isoexec_kernels.gdn_core import GDNState
from isoexec_kernels.gdn_core.chunk_form import torch_recurrence
from test_gdn_core import random_plan, run_engine, take


def _cpr4():
    from isoexec_kernels.gdn_core import cpr_chunk

    return cpr_chunk


def _ref4():
    from isoexec_kernels.gdn_core import cpr_chunk_reference

    return cpr_chunk_reference


@pytest.mark.parametrize("C,lens,seed,vdt", [(16, [40, 5, 33, 1], 40, torch.bfloat16), (64, [70, 3, 130], 41, torch.bfloat16),
                                             (16, [40, 5, 33, 1], 42, torch.float32)])
def test_cpr4_reference_trainer_engine_split_and_decode_give_the_same_bits(kb, C, lens, seed, vdt):
    R = _ref4()
    inp = make_inputs(lens, Hk=1, H=2, Dk=16, Dv=16, seed=seed, v_dtype=vdt)
    trainer = R.cpr4_varlen_reference(*inp, chunk=C)
    want = torch_recurrence(*(x.double() for x in inp[:5]), inp[5])
    assert kb.rel_l2(trainer, want) < (1e-2 if vdt == torch.bfloat16 else 1e-6), "operands by v's dtype"
    for plan_seed in (1, 2, 3):
        st = GDNState.allocate(len(lens) + 2, 2, 16, 16, "cpu", chunk=C, with_q=True, value_dtype=vdt)
        plan = random_plan(lens, plan_seed + 10 * seed, max_decode=2 * C)
        slots = list(range(len(lens) + 1, 0, -1))[:len(lens)]
        o = run_engine(inp, lens, plan, slots, st, R.cpr4_engine_reference, R.cpr4_decode_reference, C)
        kb.assert_bitwise(o, trainer, f"engine split + decode == trainer, C={C} plan {plan_seed}")


def test_block_cumsum_reference_takes_its_blocks_side_by_side_with_the_row_by_row_bits(kb):
    # the twin's G sums the blocks side by side; the same additions in the same order as one running
    # sum per block, row by row, and the blocks before it chained and added last
    from isoexec_kernels.gdn_core.reference import block_cumsum_reference

    gen = torch.Generator().manual_seed(7)
    for C in (64, 48, 24, 16, 1):
        g = -torch.rand(9, C, generator=gen) * 3
        g[0] = -0.0
        block = 16 if C % 16 == 0 else C
        want = torch.empty_like(g)
        before = None
        for a in range(C // block):
            acc = g.new_zeros(9)
            for t in range(a * block, (a + 1) * block):
                acc = acc + g[:, t]
                want[:, t] = acc if before is None else acc + before
            before = acc if before is None else before + acc
        kb.assert_bitwise(block_cumsum_reference(g), want, f"C={C}")


def _rows_vs_prefix(kb, inp, lens, plan, slots, C, state_kw):
    """Drive two states through ``plan`` (prefills by the reference prefill on both; decodes by rows
    on one, by prefix on the other), comparing each call's output and every state tensor bitwise;
    returns the in-chunk rows the decodes were at."""
    from dataclasses import fields

    R = _ref4()
    q, k, v, g, beta, cu = inp
    H, Dk, Dv = v.shape[1], k.shape[2], v.shape[2]
    sts = [GDNState.allocate(max(slots) + 2, H, Dk, Dv, "cpu", chunk=C, with_q=True, **state_kw) for _ in range(2)]
    pos, seen = [0] * len(lens), set()
    for step, (kind, arg) in enumerate(plan):
        if kind == "prefill":
            rows, cus = [], [0]
            for b, n in arg.items():
                rows += range(int(cu[b]) + pos[b], int(cu[b]) + pos[b] + n)
                cus.append(cus[-1] + n)
                pos[b] += n
            sl = torch.tensor([slots[b] for b in arg])
            outs = [R.cpr4_engine_reference(*(take(x, rows) for x in (q, k, v, g, beta)),
                                            torch.tensor(cus, dtype=torch.int32), sl, st, chunk=C) for st in sts]
        else:
            rows = [int(cu[b]) + pos[b] for b in arg]
            for b in arg:
                pos[b] += 1
            sl = torch.tensor([slots[b] for b in arg])
            seen.update(sts[0].fill[sl].tolist())
            outs = [dec(*(take(x, rows) for x in (q, k, v, g, beta)), sl, st, chunk=C)
                    for dec, st in zip((R.cpr4_decode_reference, R._decode_prefix_reference), sts)]
        kb.assert_bitwise(outs[0], outs[1], f"call {step} ({kind}): output")
        for f in fields(GDNState):
            a, b = getattr(sts[0], f.name), getattr(sts[1], f.name)
            if a is None:
                assert b is None, f.name
            elif a.is_floating_point():
                kb.assert_bitwise(a, b, f"call {step} ({kind}): state.{f.name}")
            else:
                assert torch.equal(a, b), f"call {step} ({kind}): state.{f.name}"
    assert pos == list(lens)
    return seen


@pytest.mark.parametrize("C,lens,Hk,H,Dk,Dv,vdt,buf_dt,seed", [
    (64, [150, 3, 130], 2, 4, 16, 16, torch.bfloat16, torch.bfloat16, 50),   # 4 blocks, GQA, bf16 copies
    (64, [140, 70], 1, 2, 8, 16, torch.float32, torch.float32, 51),         # fp32 values: fp32 dots
    (48, [100, 12, 61], 1, 2, 16, 8, torch.bfloat16, torch.float32, 52),    # 3 blocks, bf16 values kept in fp32
    (24, [60, 9], 1, 2, 16, 16, torch.bfloat16, torch.bfloat16, 53),        # not a multiple of 16: one block
])
def test_cpr4_reference_decode_by_rows_gives_the_prefix_decode_s_bits_in_outputs_and_state(
        kb, C, lens, Hk, H, Dk, Dv, vdt, buf_dt, seed):
    inp = make_inputs(lens, Hk=Hk, H=H, Dk=Dk, Dv=Dv, seed=seed, v_dtype=vdt)
    seen = set()
    for plan_seed in (1, 2):
        plan = random_plan(lens, plan_seed + 10 * seed, max_decode=2 * C + 8)
        seen |= _rows_vs_prefix(kb, inp, lens, plan, [4, 1, 2][:len(lens)], C, dict(value_dtype=buf_dt))
    # the plans reach what the row decode does differently by position: a chunk's first row, rows in
    # every 16-row block (the blocks left of the diagonal), the step that completes the chunk
    blocks = {t // 16 for t in seen} if C % 16 == 0 else {0}
    assert {0, C - 1} <= seen and blocks == set(range(max(1, C // 16))), sorted(seen)


def test_the_trainer_backward_is_version_3s_and_the_forward_takes_the_accuracy_of_the_values_dtype():
    from isoexec_kernels.gdn_core import gdn_cpr4_varlen, gdn_cpr_varlen

    inp = make_inputs([40, 70], Hk=1, H=2, Dk=16, Dv=16, seed=5)
    grads = []
    for fn in (gdn_cpr4_varlen, gdn_cpr_varlen):
        xs = [x.clone().requires_grad_(True) for x in inp[:5]]
        o = fn(*xs, inp[5], chunk=16)
        o.backward(torch.ones_like(o))
        grads.append([x.grad for x in xs])
    for a, b in zip(*grads):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), "only forward bits differ between versions"
    errs = {}
    with torch.no_grad():
        for vdt in (torch.bfloat16, torch.float32):
            x = list(inp)
            x[2] = x[2].to(vdt)
            got = gdn_cpr4_varlen(*x, chunk=16).double()
            want = torch_recurrence(*(y.double() for y in x[:5]), x[5])
            errs[vdt] = ((got - want).norm() / want.norm()).item()
    assert 1e-5 < errs[torch.bfloat16] < 1e-2, f"bf16 values: bf16 operands ({errs})"
    assert errs[torch.float32] < 1e-6, f"fp32 values: fp32-accurate dots ({errs})"


def test_the_chunk_form_buffers_are_allocated_counted_and_reset_only_when_asked_for():
    plain = GDNState.allocate(3, 2, 16, 8, "cpu", chunk=16)
    with_q = GDNState.allocate(3, 2, 16, 8, "cpu", chunk=16, with_q=True, value_dtype=torch.bfloat16)
    fp32 = GDNState.allocate(3, 2, 16, 8, "cpu", chunk=16, with_q=True)
    assert fp32.boundary_op is None and fp32.buf_vn_op is None, "fp32 values: fp32 operands, no bf16 copies"
    assert fp32.buf_q is not None and fp32.buf_vn is not None and fp32.buf_T is not None
    assert plain.buf_q is None and plain.buf_vn is None
    assert with_q.buf_q.shape == (3, 16, 2, 16) and with_q.buf_vn.shape == (3, 16, 2, 8)
    assert with_q.buf_T.shape == (3, 16, 2, 16) and plain.buf_T is None
    assert with_q.boundary_op.shape == (3, 2, 16, 8) and with_q.boundary_op.dtype == torch.bfloat16
    assert with_q.buf_vn_op.shape == (3, 16, 2, 8) and with_q.buf_vn_op.dtype == torch.bfloat16
    assert plain.boundary_op is None and plain.buf_vn_op is None
    chunk_form = 3 * 16 * 2 * 16 * 4 + 3 * 16 * 2 * 8 * 4 + 3 * 16 * 2 * 16 * 4    # buf_q, buf_vn, buf_T
    assert fp32.nbytes - plain.nbytes == chunk_form
    # + the bf16 copies of the boundary and of Vn, - half of buf_v (kept in bf16)
    assert with_q.nbytes - plain.nbytes == chunk_form + 3 * 2 * 16 * 8 * 2 + 3 * 16 * 2 * 8 * 2 - 3 * 16 * 2 * 8 * 2
    for buf in (with_q.buf_q, with_q.buf_vn, with_q.buf_T, with_q.boundary_op, with_q.buf_vn_op):
        buf.fill_(1.0)
    plain.reset_(torch.tensor([1]))                  # no buffer, nothing to reset: no error
    with_q.reset_(torch.tensor([1]))
    for buf in (with_q.buf_q, with_q.buf_vn, with_q.buf_T, with_q.boundary_op, with_q.buf_vn_op):
        assert not buf[1].any() and buf[0].all() and buf[2].all()


def test_a_chunk_form_state_keeps_values_in_their_dtype_and_refuses_others():
    C4, R = _cpr4(), _ref4()
    kept = GDNState.allocate(2, 2, 16, 8, "cpu", chunk=16, with_q=True, value_dtype=torch.bfloat16)
    plain = GDNState.allocate(2, 2, 16, 8, "cpu", chunk=16, value_dtype=torch.bfloat16)
    assert kept.buf_v.dtype == torch.bfloat16 and plain.buf_v.dtype == torch.float32, \
        "only the chunk form keeps v in its dtype (the other cores' kernels read fp32 buffers)"
    inp = make_inputs([5], Hk=1, H=2, Dk=16, Dv=8, seed=3, v_dtype=torch.float32)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="value_dtype=torch.float32"):
        R.cpr4_engine_reference(*inp[:5], cu, torch.tensor([1]), kept, chunk=16)
    assert not kept.fill.any() and not kept.buf_v.any(), "refused before any write"
    with pytest.raises(ValueError, match="value_dtype"):
        C4.cpr4_decode_rows_triton(*(x[:1] for x in inp[:5]), torch.tensor([1]), kept, C4.CPR4_CHOICE, chunk=16)


def test_cpr4_reference_with_a_bf16_value_buffer_gives_the_fp32_buffer_s_bits():
    R = _ref4()
    C, lens = 16, [40, 5, 33]
    inp = make_inputs(lens, Hk=1, H=2, Dk=16, Dv=16, seed=36, v_dtype=torch.bfloat16)
    plan = random_plan(lens, 36, max_decode=20)
    outs = []
    for vdt in (torch.float32, torch.bfloat16):
        st = GDNState.allocate(len(lens) + 2, 2, 16, 16, "cpu", chunk=C, with_q=True, value_dtype=vdt)
        outs.append(run_engine(inp, lens, plan, [3, 1, 2], st, R.cpr4_engine_reference, R.cpr4_decode_reference, C))
    assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))


def test_cpr4_reference_refuses_a_state_without_the_query_buffer():
    R = _ref4()
    inp = make_inputs([5], Hk=1, H=2, Dk=16, Dv=16, seed=42)
    st = GDNState.allocate(2, 2, 16, 16, "cpu", chunk=16)
    with pytest.raises(ValueError, match="with_q=True"):
        R.cpr4_engine_reference(*inp[:5], inp[5], torch.tensor([1]), st, chunk=16)


def test_the_triton_engine_prefill_refuses_two_sequences_on_one_slot_before_any_launch():
    # its state kernel reads and writes the slots' boundaries in place, race-free only with a slot
    # per sequence; the refusal comes before any kernel, so it holds on any machine
    C4 = _cpr4()
    inp = make_inputs([5, 3], Hk=1, H=2, Dk=16, Dv=16, seed=44, v_dtype=torch.bfloat16)
    st = GDNState.allocate(3, 2, 16, 16, "cpu", chunk=16, with_q=True, value_dtype=torch.bfloat16)
    before = [t.clone() for t in st.tensors()]
    with pytest.raises(ValueError, match="each sequence needs a state slot of its own"):
        C4.cpr4_engine_triton(*inp[:5], inp[5], torch.tensor([1, 1]), st, chunk=16)
    assert all(torch.equal(a, b) for a, b in zip(before, st.tensors())), "the refused call changed the state"


def test_the_row_decode_refuses_a_completion_lane_count_that_is_no_power_of_two_before_any_launch():
    C4 = _cpr4()
    inp = make_inputs([3], Hk=1, H=2, Dk=16, Dv=16, seed=45, v_dtype=torch.bfloat16)
    st = GDNState.allocate(2, 2, 16, 16, "cpu", chunk=16, with_q=True, value_dtype=torch.bfloat16)
    before = [t.clone() for t in st.tensors()]
    with pytest.raises(ValueError, match="complete_lanes must be a power of two, got 3"):
        _decode_rows(complete_lanes=3)(*(x[:1] for x in inp[:5]), torch.tensor([1]), st, chunk=16)
    assert all(torch.equal(a, b) for a, b in zip(before, st.tensors())), "the refused call changed the state"


def _decode_rows(**kw):
    """The row decode with the pinned choice and ``kw`` (cpr4_decode_rows_triton's options)."""
    from isoexec_kernels.gdn_core import cpr_row_decode as RD

    def dec(q, k, v, g, beta, sl, state, *, chunk):
        return RD.cpr4_decode_rows_triton(q, k, v, g, beta, sl, state, _cpr4().CPR4_CHOICE, chunk=chunk, **kw)
    return dec


def interp_case_cpr4_trainer_engine_split_and_decode_give_the_same_bits(kb):
    C4 = _cpr4()
    # C = 16 (lens [26, 5, 35]): a prefill piece across a chunk boundary from a partly filled chunk
    # (sequence 2, rows 2..28), an empty piece, a first token by decode onto an empty slot (sequence
    # 1), two sequences completing a chunk by decode in one step (rows 15 and 31), prefill onto chunks
    # whose first rows came from decode, up to three lanes;
    # C = 64 (lens [70]): a piece across the boundary from a partly filled chunk, then decode steps
    # (C = 64 decode in every row block and its completion: the row decode case; lanes side by side:
    # C = 16)
    # (the decode lists' order is the lanes': sequences 2 and 0, which complete chunks, on lanes 1
    # and 2, so that with two lanes per completion program they sit in different programs)
    plan16 = [("prefill", {0: 5, 1: 0, 2: 2}), ("prefill", {0: 8, 2: 27}), ("decode", [1, 2, 0]),
              ("decode", [2, 0]), ("decode", [1, 2, 0]), ("prefill", {0: 6, 1: 2}), ("decode", [1, 2, 0]),
              ("prefill", {0: 2, 2: 2}), ("decode", [0])]
    plan64 = [("prefill", {0: 30}), ("prefill", {0: 37})] + [("decode", [0])] * 3
    for C, lens, seed, plan in ((16, [26, 5, 35], 30, plan16), (64, [70], 31, plan64)):
        inp = make_inputs(lens, Hk=1, H=2, Dk=16, Dv=16, seed=seed, v_dtype=torch.bfloat16)
        trainer = C4.cpr4_varlen_triton(*inp, chunk=C)
        want = torch_recurrence(*(x.double() for x in inp[:5]), inp[5])
        assert kb.rel_l2(trainer, want) < 3e-2, "bf16 operands (truncated by the interpreter)"
        st = GDNState.allocate(len(lens) + 2, 2, 16, 16, "cpu", chunk=C, with_q=True)
        slots = list(range(len(lens) + 1, 0, -1))[:len(lens)]
        # three lanes on completion programs of two lanes each: the second program's block is
        # partial, and the two lanes that complete a chunk in one step fall in either program
        o = run_engine(inp, lens, plan, slots, st, C4.cpr4_engine_triton, _decode_rows(complete_lanes=2), C)
        kb.assert_bitwise(o, trainer, f"engine split + decode by rows == trainer, C={C}")
        # (the prefix decode, the row decode's yardstick on the GPU, gives the trainer's bits in the
        # next two cases: fp32 values, and bf16 values in a bf16 value buffer)


def interp_case_cpr4_fp32_values_take_fp32_dots_and_keep_the_trainer_bits(kb):
    # fp32 values: tf32x3 dots (CPR4_CHOICE_FP32), no bf16 copies in the state, the pinned decode
    # (by prefix: ROW_DECODE_DOTS) and the engine split give the trainer's bits, at fp32 accuracy
    C4 = _cpr4()
    C, lens = 16, [35, 5]
    inp = make_inputs(lens, Hk=1, H=2, Dk=16, Dv=16, seed=37, v_dtype=torch.float32)
    assert C4.cpr4_choice(torch.float32).dot == "tf32x3" and "tf32x3" not in C4.ROW_DECODE_DOTS
    trainer = C4.cpr4_varlen_triton(*inp, chunk=C)
    want = torch_recurrence(*(x.double() for x in inp[:5]), inp[5])
    assert kb.rel_l2(trainer, want) < 1e-5, "fp32 values: fp32-accurate dots"
    st = GDNState.allocate(len(lens) + 2, 2, 16, 16, "cpu", chunk=C, with_q=True, value_dtype=torch.float32)
    assert st.boundary_op is None and st.buf_vn_op is None
    # a split prefill (sequence 0's second piece across a boundary from a partly filled chunk), then
    # decode steps on two lanes, sequence 0's completing its second chunk (t = 15, from a boundary that
    # is not zero) and going on into the next one
    plan = ([("prefill", {0: 6, 1: 1}), ("prefill", {0: 23, 1: 2})] + [("decode", [0, 1])] * 2
            + [("decode", [0])] * 4)
    o = run_engine(inp, lens, plan, [3, 1], st, C4.cpr4_engine_triton, C4.cpr4_decode_triton, C)
    kb.assert_bitwise(o, trainer, "fp32 values: engine split + pinned decode == trainer")


def interp_case_cpr4_row_decode_makes_every_row_block_of_t_from_the_kept_rows(kb):
    # C = 64: prefill 31 rows (row block 1 open), then decode steps in row blocks 1, 2 and 3: the
    # row-inverse kernel's branches for them (each from the kept rows of T), the chunk's completion
    # at row 63 and row block 0 of the next chunk
    C4 = _cpr4()
    C, lens = 64, [66]
    # weak decay: the blocks of T left of the diagonal stay far from zero, so that an error in them
    # moves output bits (a 0.1% error in the left blocks of row block 1, 2 or 3 moves some here; at the
    # default g_scale, 0.5, a 5% error in those of block 2 or 3 moved none of these steps' outputs,
    # and the 40 decode steps this case took before missed 0.1% in block 1's or block 3's)
    inp = make_inputs(lens, Hk=1, H=2, Dk=16, Dv=16, seed=34, v_dtype=torch.bfloat16, g_scale=0.05)
    trainer = C4.cpr4_varlen_triton(*inp, chunk=C)
    st = GDNState.allocate(2, 2, 16, 16, "cpu", chunk=C, with_q=True)
    # decode steps where row blocks meet, prefill between them (prefill keeps rows of T too): row 15
    # of block 1 and rows 0, 1 of block 2 (31..33), 15 of block 2 and 0, 1 of block 3 (47..49), 15 of
    # block 3 (63: the completion) and 0, 1 of block 0 of the next chunk (64, 65); the rows of T that
    # the blocks left of the diagonal take come from decode (rows 31, 47) and from prefill (the
    # others); a row inside a block differs from these only in the diagonal loop's count
    plan = ([("prefill", {0: 31})] + [("decode", [0])] * 3 + [("prefill", {0: 13})] + [("decode", [0])] * 3
            + [("prefill", {0: 13})] + [("decode", [0])] * 3)
    o = run_engine(inp, lens, plan, [1], st, C4.cpr4_engine_triton, C4.cpr4_decode_triton, C)
    kb.assert_bitwise(o, trainer, "decode steps by rows in every row block == trainer, C=64")
    assert int(st.fill[1]) == 66 - 64 and st.buf_T[1, :2].any() and not st.buf_T[1, :2, :, 16:].any(), \
        "the new chunk's rows of T: zero right of the first diagonal block"


def interp_case_cpr4_decode_choices_and_a_bf16_value_buffer_keep_the_trainer_bits(kb):
    # the choices of the row decode that are not the default (the row-inverse and W/M parts as one
    # launch; two Dv tiles per completion program: Dv = 64 is two of the fp32 state kernel's tiles)
    # and the open chunk's values kept in their bf16: the trainer's bits with each, across a chunk
    # boundary (C = 16)
    from isoexec_kernels.gdn_core import cpr_row_decode as RD

    C4 = _cpr4()
    C, lens = 16, [33, 5]
    inp = make_inputs(lens, Hk=1, H=2, Dk=16, Dv=64, seed=35, v_dtype=torch.bfloat16)
    trainer = C4.cpr4_varlen_triton(*inp, chunk=C)
    # sequence 0 decodes rows 29..32: the step that completes its second chunk (t = 15, the completion
    # kernel, from a boundary that is not zero: a first chunk's would leave its e^G S term untested),
    # then row 0 of the next chunk from the new boundary; sequence 1 beside it on a second lane for
    # two steps (each step is a launch of every kernel, whatever the rows)
    plan = [("prefill", {0: 29, 1: 3})] + [("decode", [0, 1])] * 2 + [("decode", [0])] * 2
    slots = [2, 1]
    # every run below completes the chunk on two Dv tiles per completion program: the default
    # (COMPLETE_TILES) is capped at the 2 tiles of Dv = 64, so the run of its own that asked for
    # complete_tiles=2 (until this was cut for the CPU's time) made the bf16 value buffer run's
    # launches, with the fp32 value buffer the other cases take; the fused-prep run asks for 2
    # explicitly, so that it stays covered if the default changes
    assert min(RD.COMPLETE_TILES, 64 // 32) == 2 and RD.COMPLETE_LANES >= len(slots)
    for label, kw, vdt in (("fused prep, two Dv tiles per completion program", dict(fused_prep=True, complete_tiles=2),
                            torch.float32),
                           # a completion program per lane (the two lanes share one by default)
                           ("one lane per completion program", dict(complete_lanes=1), torch.float32),
                           ("bf16 value buffer", {}, torch.bfloat16),
                           ("by prefix, bf16 value buffer", None, torch.bfloat16)):
        def dec(q, k, v, g, beta, sl, state, *, chunk):
            if kw is None:
                return C4.cpr4_decode_prefix_triton(q, k, v, g, beta, sl, state, chunk=chunk)
            return RD.cpr4_decode_rows_triton(q, k, v, g, beta, sl, state, C4.CPR4_CHOICE, chunk=chunk, **kw)
        st = GDNState.allocate(len(lens) + 2, 2, 16, 64, "cpu", chunk=C, with_q=True, value_dtype=vdt)
        assert st.buf_v.dtype == vdt
        o = run_engine(inp, lens, plan, slots, st, C4.cpr4_engine_triton, dec, C)
        kb.assert_bitwise(o, trainer, f"engine split + decode by rows ({label}) == trainer")


def interp_case_cpr4_decode_from_scratch_after_a_reset_repeats_its_bits(kb):
    C4 = _cpr4()
    C = 16
    # rows 9..16 by decode: one chunk completed by decode (t = 15), one row of the next chunk, so
    # that the slot holds a boundary, an open chunk and kept rows of T when it is reset
    lens = [17]
    inp = make_inputs(lens, Hk=1, H=2, Dk=16, Dv=16, seed=33, v_dtype=torch.bfloat16)
    st = GDNState.allocate(2, 2, 16, 16, "cpu", chunk=C, with_q=True)
    plan = [("prefill", {0: 9})] + [("decode", [0])] * 8
    first = run_engine(inp, lens, plan, [1], st, C4.cpr4_engine_triton, C4.cpr4_decode_triton, C)
    assert int(st.fill[1]) == 1 and st.boundary[1].any() and st.buf_T[1, 0].any(), "nothing to reset"
    st.reset_(torch.tensor([1]))
    assert int(st.fill[1]) == 0 and not st.boundary[1].any()
    assert not any(b[1].any() for b in (st.buf_q, st.buf_vn, st.buf_T))
    again = run_engine(inp, lens, plan, [1], st, C4.cpr4_engine_triton, C4.cpr4_decode_triton, C)
    kb.assert_bitwise(again, first, "the same sequence again after a slot reset")


def interp_case_cpr4_kernels_agree_with_the_reference_twin(kb):
    from isoexec_kernels.gdn_core import native_wy as NW
    from test_gdn_native_wy import trunc_bf16

    C4, R = _cpr4(), _ref4()
    for C, lens in ((16, [40, 5]), (64, [70])):
        inp = make_inputs(lens, Hk=1, H=2, Dk=16, Dv=16, seed=43, v_dtype=torch.bfloat16)
        got = C4.cpr4_varlen_triton(*inp, chunk=C)
        keep = NW.round_bf16
        NW.round_bf16 = trunc_bf16   # the interpreter truncates where a GPU rounds to nearest even
        try:
            twin = R.cpr4_varlen_reference(*inp, chunk=C)
        finally:
            NW.round_bf16 = keep
        assert kb.rel_l2(got, twin) < 1e-4, C


@pytest.mark.parametrize("case", sorted(n for n in list(globals()) if n.startswith("interp_case_")))
def test_gdn_cpr4_under_interpreter(interp_results, kb, case):
    kb.check_interp(interp_results, "test_gdn_cpr4", case)
