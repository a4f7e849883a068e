"""Paged KV-cache pages and recurrent-state slots, handed to sequences and taken back.

A sequence owns ``block_table``: the ids of the pages holding its key positions
``[i * page_size, (i + 1) * page_size)`` for page i. Pages are allocated as a sequence's tokens
are scheduled (a prefill chunk or one decode token at a time) and all freed when it finishes or
is preempted. Which physical page a token lands on never changes its bits (attention walks
absolute positions; ``isoexec_kernels.attention``), so the free list is a plain FIFO.

Families with recurrent layers (hybrid: Gated DeltaNet) also keep one fixed-size state per
sequence; ``num_state_slots`` such slots form a pool. A sequence takes a slot when it is
admitted and gives it back with its pages; a slot freshly taken must be zeroed by the runner
before the sequence's first chunk (``Sequence.num_computed == 0``).
"""

from __future__ import annotations

from collections import deque

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_pages: int, page_size: int = 16, num_state_slots: int = 0):
        assert num_pages >= 1 and page_size >= 1 and num_state_slots >= 0
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_state_slots = num_state_slots
        self.free_pages: deque[int] = deque(range(num_pages))
        self.free_slots: deque[int] = deque(range(num_state_slots))

    # ------------------------------------------------------------------------------ pages
    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages_needed(self, seq: Sequence, num_new: int) -> int:
        """Pages ``seq`` must gain so its next ``num_new`` tokens have slots."""
        return max(0, self.pages_for(seq.num_computed + num_new) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new: int) -> bool:
        return self.pages_needed(seq, num_new) <= len(self.free_pages)

    def max_new_tokens(self, seq: Sequence) -> int:
        """The most new tokens ``seq`` can take with its pages plus every free page."""
        return (len(seq.block_table) + len(self.free_pages)) * self.page_size - seq.num_computed

    def allocate(self, seq: Sequence, num_new: int) -> None:
        """Give ``seq`` the pages its next ``num_new`` tokens need."""
        need = self.pages_needed(seq, num_new)
        if need > len(self.free_pages):
            raise RuntimeError(f"request {seq.request_id}: needs {need} KV page(s), {len(self.free_pages)} free; "
                               "the scheduler should have preempted or waited")
        for _ in range(need):
            seq.block_table.append(self.free_pages.popleft())

    def may_append(self, seq: Sequence) -> bool:
        """Whether one more (decode) token of ``seq`` fits."""
        return self.can_allocate(seq, 1)

    def append(self, seq: Sequence) -> None:
        self.allocate(seq, 1)

    def free(self, seq: Sequence) -> None:
        """Return every page and the state slot of ``seq`` (finish or preemption)."""
        self.free_pages.extend(seq.block_table)
        seq.block_table = []
        self.free_state(seq)

    # ------------------------------------------------------------------------------ state slots
    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def can_allocate_state(self) -> bool:
        """True when the pool is off (no recurrent layers) or a slot is free."""
        return self.num_state_slots == 0 or bool(self.free_slots)

    def allocate_state(self, seq: Sequence) -> None:
        if self.num_state_slots == 0:
            return
        if seq.state_slot is not None:
            raise RuntimeError(f"request {seq.request_id} already holds state slot {seq.state_slot}")
        if not self.free_slots:
            raise RuntimeError(f"request {seq.request_id}: no free recurrent-state slot "
                               f"(pool of {self.num_state_slots}); raise num_state_slots")
        seq.state_slot = self.free_slots.popleft()

    def free_state(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = None

    # ------------------------------------------------------------------------------ checks
    def check(self, live: list[Sequence]) -> None:
        """Every page and slot is either free or owned by exactly one live sequence."""
        owned = [p for s in live for p in s.block_table]
        pages = owned + list(self.free_pages)
        assert sorted(pages) == list(range(self.num_pages)), "KV pages leaked or owned twice"
        slots = [s.state_slot for s in live if s.state_slot is not None] + list(self.free_slots)
        assert sorted(slots) == list(range(self.num_state_slots)), "state slots leaked or owned twice"
