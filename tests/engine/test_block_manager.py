"""KV pages and recurrent-state slots: allocation, append at page boundaries, free, pools."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isoexec.engine import BlockManager, SamplingParams, Sequence


def _seq(n_prompt: int, rid: int = 0) -> Sequence:
    return Sequence(rid, list(range(1, n_prompt + 1)), SamplingParams())


def test_allocate_covers_exactly_the_scheduled_tokens():
    bm = BlockManager(num_pages=10, page_size=4)
    s = _seq(9)
    assert bm.pages_needed(s, 9) == 3
    bm.allocate(s, 5)                      # first chunk: tokens 0..4
    assert len(s.block_table) == 2 and bm.num_free_pages == 8
    s.num_computed = 5
    bm.allocate(s, 3)                      # tokens 5..7 still fit in page 2 of 2
    assert len(s.block_table) == 2
    s.num_computed = 8
    assert bm.pages_needed(s, 1) == 1      # token 8 opens page 3
    bm.allocate(s, 1)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3


def test_may_append_is_false_at_a_page_boundary_without_free_pages():
    bm = BlockManager(num_pages=2, page_size=4)
    s = _seq(8)
    bm.allocate(s, 8)
    s.num_computed = 7
    assert bm.may_append(s)                # token 7 is in the last owned page
    s.num_computed = 8
    assert not bm.may_append(s)            # token 8 needs a third page
    with pytest.raises(RuntimeError, match="needs 1 KV page"):
        bm.append(s)


def test_free_returns_every_page_and_the_state_slot():
    bm = BlockManager(num_pages=6, page_size=2, num_state_slots=2)
    a, b = _seq(5, 0), _seq(3, 1)
    for s in (a, b):
        bm.allocate_state(s)
        bm.allocate(s, s.num_tokens)
    bm.check([a, b])
    assert bm.num_free_pages == 1 and bm.num_free_slots == 0
    bm.free(a)
    assert a.block_table == [] and a.state_slot is None
    assert bm.num_free_pages == 4 and bm.num_free_slots == 1
    bm.check([b])


def test_state_slots_are_a_bounded_pool():
    bm = BlockManager(num_pages=4, page_size=4, num_state_slots=1)
    a, b = _seq(2, 0), _seq(2, 1)
    bm.allocate_state(a)
    assert a.state_slot == 0 and not bm.can_allocate_state()
    with pytest.raises(RuntimeError, match="no free recurrent-state slot"):
        bm.allocate_state(b)
    with pytest.raises(RuntimeError, match="already holds"):
        bm.allocate_state(a)
    bm.free_state(a)
    bm.allocate_state(b)
    assert b.state_slot == 0


def test_state_pool_off_means_no_slots_and_no_limit():
    bm = BlockManager(num_pages=4, page_size=4, num_state_slots=0)
    s = _seq(2)
    assert bm.can_allocate_state()
    bm.allocate_state(s)
    assert s.state_slot is None


@settings(max_examples=60, deadline=None)
@given(page_size=st.integers(1, 8), num_pages=st.integers(1, 12),
       ops=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 9)), max_size=40))
def test_pages_are_never_leaked_or_shared(page_size, num_pages, ops):
    bm = BlockManager(num_pages=num_pages, page_size=page_size, num_state_slots=2)
    seqs = [_seq(1, i) for i in range(4)]
    for which, n in ops:
        s = seqs[which]
        if n == 9:
            bm.free(s)
            s.num_computed = 0
        elif bm.can_allocate(s, n):
            if s.state_slot is None and bm.can_allocate_state():
                bm.allocate_state(s)
            bm.allocate(s, n)
            s.num_computed += n
            assert len(s.block_table) * page_size >= s.num_computed
        else:
            assert bm.max_new_tokens(s) < n
        bm.check(seqs)
