"""Engine configuration: one dataclass, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    """Sizes and policies of the rollout engine. None of them can change a logprob's bits: the
    kernels of an IsoExec composition are invariant to batch composition, chunking and page
    layout, which is exactly what the engine gates check."""

    max_num_batched_tokens: int = 2048   # tokens per step (decode rows + prefill chunks)
    max_num_seqs: int = 64               # sequences running at once
    num_pages: int = 1024                # KV-cache pages (all layers share the page ids)
    page_size: int | None = None         # tokens per page; None: the contract's kv_pages PAGE_SIZE
    chunk_align: int = 64                # a non-final prefill chunk ends on a multiple of this
    num_state_slots: int = 0             # recurrent-state slots (hybrid families); 0: none
    max_model_len: int | None = None     # longest sequence; None: the model's max positions
    cuda_graphs: bool = False            # capture decode steps (CUDA only; opt-in, see model_runner)
    graph_batch_sizes: tuple[int, ...] | None = None  # None: 1, 2, 4, 8, 16, 32, ... max_num_seqs
    # while decodes run, prefill chunks join a step only after this many decode-only steps
    # (scheduler docstring); None: 4 with CUDA graphs (an eager prefill step costs about ten
    # graph decode steps of host time on the H200), 0 (every step) without
    prefill_interval: int | None = None
    log_every: int = 0                   # one progress line to stderr every N steps; 0: silent
    # keep the whole fp32 log-softmax row of every sampled position in ``runner.full_rows`` (the
    # engine_full_vocab gate; RL losses over the whole distribution); off: nothing is computed
    record_full_logprobs: bool = False
    # plan and launch the next decode step before reading this one's tokens (engine.py, "Decode
    # lookahead"): the host's scheduling and staging then overlap the device's work. Scheduling
    # only: the tokens and logprobs are those of a run without it (the kernels are batch
    # invariant), tested on CPU and inside CUDA graphs on the H200, where it raised decode from
    # 22.3% to 24.9% of the HBM roofline and staggered arrivals from 3,620 to 6,420 tok/s
    overlap_decode: bool = True

    def __post_init__(self):
        assert self.max_num_seqs >= 1, "max_num_seqs must be >= 1"
        assert self.num_pages >= 1, "num_pages must be >= 1"
        assert self.page_size is None or self.page_size >= 1, "page_size must be >= 1"
        assert self.chunk_align >= 1, "chunk_align must be >= 1"
        assert self.max_num_batched_tokens >= self.chunk_align, (
            f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= chunk_align "
            f"({self.chunk_align}), otherwise a long prompt could never be chunked")
        assert self.num_state_slots >= 0, "num_state_slots must be >= 0"
        assert self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2"
        assert self.log_every >= 0, "log_every must be >= 0"
        assert self.prefill_interval is None or self.prefill_interval >= 0, "prefill_interval must be >= 0"
        if self.graph_batch_sizes is not None:
            self.graph_batch_sizes = tuple(sorted(set(self.graph_batch_sizes)))
            assert self.graph_batch_sizes and self.graph_batch_sizes[0] >= 1, "graph batch sizes must be >= 1"

    def effective_prefill_interval(self, graphs_in_use: bool) -> int:
        """``prefill_interval``, or its default: 4 when decode steps replay CUDA graphs, else 0."""
        if self.prefill_interval is not None:
            return self.prefill_interval
        return 4 if graphs_in_use else 0

    def decode_buckets(self) -> tuple[int, ...]:
        """Batch sizes captured as CUDA graphs; a decode step of n sequences replays the
        smallest bucket >= n with the extra lanes padded."""
        if self.graph_batch_sizes is not None:
            return self.graph_batch_sizes
        sizes, b = [], 1
        while b < self.max_num_seqs:
            sizes.append(b)
            b *= 2
        return tuple(sizes + [self.max_num_seqs])
