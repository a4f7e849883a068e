"""Runs one scheduled step on the unified model and samples the next tokens.

A step with any prefill chunk is one ``engine_prefill`` call (decode rows are chunks of length
1 inside it: mixed batches are allowed); a step of decode tokens only is an ``engine_decode``
call. The model writes the new K/V into the paged cache and returns final-norm hidden states;
the runner gathers the last row of every sequence whose chunk reaches its last token, computes
their logits through the contract's ``lm_head`` region and hands them to the sampler, whose
logprobs come from the contract's ``logprob`` region (``model.logprobs_from_logits``, the
callable ``model.token_logprobs`` uses, so no second lm_head GEMM is run).

CUDA graphs (``DecodeGraphs``): on a CUDA device, decode steps replay graphs captured for a few
batch sizes; a step of n sequences uses the smallest bucket >= n, and the extra lanes are inert
(slot -1: they never write the cache; context length 1 on page 0: they only read; their outputs
are dropped). Only the model body is captured; logits and sampling run eagerly on the real rows.
Parameters are updated in place by ``Engine.update_weights``, so captured graphs stay valid.
Graphs are opt-in (``EngineConfig.cuda_graphs``); on the H200 the graph == eager gate
(``engine_graph_eager``) passed with 0 differing logprobs for the dense family. Every op of the
decode forward stays on the device (rope from the model's device table, attention grids from
static sizes), which capture requires.

Recurrent (hybrid) families: each running sequence owns a state slot holding, per GDN layer, its
delta-rule state, open chunk and conv window; the runner zeroes a slot when its sequence starts
from token 0 (admission, recompute after preemption) and every slot on a weight update. One extra
scratch slot takes the state updates of padded graph lanes.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..model.batch import ForwardBatch, KVCache
from .sampler import SampleOutput, Sampler
from .scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model, num_pages: int, page_size: int, max_model_len: int, max_num_seqs: int,
                 cuda_graphs: bool = False, graph_batch_sizes: tuple[int, ...] = (), num_state_slots: int = 0,
                 record_full_logprobs: bool = False):
        self.model = model
        cfg = model.cfg
        self.device = model.embed.device
        self.page_size = page_size
        # one KV cache per attention layer (hybrid families have fewer than num_layers), of the kv
        # heads this process computes (a tensor-parallel model's ``kv_cache_heads``: its share)
        self.kv = KVCache.allocate(getattr(cfg, "num_kv_layers", cfg.num_layers), num_pages, page_size,
                                   getattr(model, "kv_cache_heads", cfg.num_kv_heads), cfg.head_dim,
                                   model.embed.dtype, self.device)
        # Recurrent families: per-layer state slots, plus one scratch slot (index num_state_slots)
        # that the padded lanes of a decode graph read and write, so real slots stay untouched.
        self.recurrent = hasattr(model, "allocate_recurrent_state")
        self.gdn_states, self.conv_states = (model.allocate_recurrent_state(num_state_slots + 1)
                                             if self.recurrent else (None, None))
        self.scratch_slot = num_state_slots
        self.sampler = Sampler()
        self.graphs: Optional[DecodeGraphs] = None
        self.graph_replays = 0                      # decode steps served by a graph (gates check > 0)
        # Opt-in record of the whole fp32 log-softmax row of every sampled position (request id,
        # position of the sampled token, row), from the very logits the sampler chose from; None
        # (the default) computes and keeps nothing. ``EngineConfig.record_full_logprobs``.
        self.full_rows: Optional[list[tuple[int, int, torch.Tensor]]] = [] if record_full_logprobs else None
        if cuda_graphs and self.device.type == "cuda" and torch.cuda.is_available():
            max_pages = -(-max_model_len // page_size)
            sizes = tuple(b for b in graph_batch_sizes if b <= max_num_seqs)
            self.graphs = DecodeGraphs(model, self.kv, sizes, max_pages, self.gdn_states, self.conv_states,
                                       self.scratch_slot)

    def forward(self, batch: ScheduledBatch, ahead_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, str]:
        """Hidden rows [T, H] of the step's new tokens and the case they ran under. A lookahead
        batch (``batch.ahead``) takes its input tokens from ``ahead_ids`` (int64 [B] on the
        device: the previous step's samples) at one position past ``Sequence.num_computed``."""
        seqs, counts = batch.seqs, batch.num_tokens
        case = "engine_decode" if batch.is_decode else "engine_prefill"
        if batch.ahead:
            if ahead_ids is None or ahead_ids.shape[0] != len(seqs):
                raise ValueError("ModelRunner: a lookahead batch needs one input token per sequence (ahead_ids)")
            ids = ahead_ids
            starts = [s.num_computed + 1 for s in seqs]
        else:
            ids = [t for s, n in zip(seqs, counts) for t in s.token_ids[s.num_computed:s.num_computed + n]]
            starts = [s.num_computed for s in seqs]
        tables = [s.block_table for s in seqs]
        state = {}
        if self.recurrent:
            fresh = [s.state_slot for s in seqs if s.num_computed == 0]
            if fresh:   # a newly admitted sequence, or one recomputed after preemption: zero state
                self.reset_state(fresh)
            state = dict(gdn_states=self.gdn_states, conv_states=self.conv_states,
                         state_slots=[s.state_slot for s in seqs])
        if self.graphs is not None and batch.is_decode and self.graphs.bucket(len(seqs)) is not None:
            self.graph_replays += 1
            return self.graphs.run(ids, tables, starts, self.page_size, state.get("state_slots")), case
        fb = ForwardBatch.paged(case, self.kv, tables, starts, counts, self.device, **state)
        ids_t = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.int64, device=self.device)
        return self.model.hidden_states(ids_t, fb), case

    def reset_state(self, slots) -> None:
        """Zero the recurrent state of ``slots`` (all slots if None); a no-op for attention-only models."""
        if self.recurrent:
            idx = torch.arange(self.scratch_slot + 1) if slots is None else torch.tensor(list(slots))
            self.model.reset_recurrent_state(self.gdn_states, self.conv_states, idx)

    @torch.no_grad()
    def run(self, batch: ScheduledBatch, ahead_ids: Optional[torch.Tensor] = None) -> Optional[SampleOutput]:
        """Run the step; sample for each sequence whose chunk reaches its last token.
        ``ahead_ids``: the input tokens of a lookahead batch (:meth:`forward`)."""
        samples = batch.samples
        if not any(samples):
            self.forward(batch, ahead_ids)
            return None
        picked = [s for s, keep in zip(batch.seqs, samples) if keep]
        # a lookahead batch runs one token past what its sequences record (forward)
        shift = 1 if batch.ahead else 0
        # everything the sampler needs goes to the device before the forward is launched, so no
        # host-to-device copy has to wait for the forward (a pageable copy syncs the stream)
        plan = self.sampler.plan([s.params for s in picked], [s.request_id for s in picked],
                                 [s.num_tokens + shift for s in picked], self.device)
        rows = None
        if not (batch.is_decode and all(samples)):          # decode: every row is its sequence's last
            ends = torch.tensor(batch.num_tokens, dtype=torch.int64).cumsum(0) - 1
            rows = ends[torch.tensor(samples)].to(self.device, non_blocking=True)
        hidden, case = self.forward(batch, ahead_ids)
        logits = self.model.logits(hidden if rows is None else hidden[rows], case)

        def logprob(lg, targets):
            return self.model.logprobs_from_logits(lg, targets, case)

        out = self.sampler.sample(logits, plan, logprob)
        if self.full_rows is not None:
            # eager, after the sampler (never inside a captured graph); the rows stay on the
            # device, so recording adds no host sync
            full = self.model.log_softmax_from_logits(logits, case)
            self.full_rows.extend((s.request_id, s.num_tokens + shift, full[i]) for i, s in enumerate(picked))
        return out


class DecodeGraphs:
    """CUDA-graph capture and replay of ``engine_decode`` steps, one graph per batch bucket.
    CUDA only; docs/gates.md family 4 (replay with padded lanes == eager) checks it on the GPU."""

    def __init__(self, model, kv: KVCache, batch_sizes: tuple[int, ...], max_pages_per_seq: int,
                 gdn_states=None, conv_states=None, scratch_slot: int = 0):
        self.model = model
        self.kv = kv
        self.gdn_states, self.conv_states, self.scratch_slot = gdn_states, conv_states, scratch_slot
        dev = model.embed.device
        self.sizes = tuple(sorted(batch_sizes))
        top = self.sizes[-1]
        self.width = max_pages_per_seq
        # The step's inputs are staged in two pinned host buffers (int64: ids, positions, slots;
        # int32: block table, context lengths, state slots) and copied in two asynchronous copies
        # into the device buffers the graphs read; the static inputs are views into those.
        n64, n32 = 3 * top, top * (max_pages_per_seq + 2)
        self.host64 = torch.zeros(n64, dtype=torch.int64, pin_memory=True)
        self.host32 = torch.zeros(n32, dtype=torch.int32, pin_memory=True)
        self.dev64 = torch.zeros(n64, dtype=torch.int64, device=dev)
        self.dev32 = torch.zeros(n32, dtype=torch.int32, device=dev)
        self.copied = None                          # event: the last staging copy has been read
        self.ids, self.positions, self.slot_mapping = self.dev64[:top], self.dev64[top:2 * top], self.dev64[2 * top:]
        tw = top * max_pages_per_seq
        self.block_table = self.dev32[:tw].view(top, max_pages_per_seq)
        self.context_lens = self.dev32[tw:tw + top]
        # recurrent families: padded lanes use the scratch slot (their state updates land there)
        self.state_slots = self.dev32[tw + top:]
        self.stage(0, [], [], [], 1, None)          # padded-lane values everywhere
        self.dev64.copy_(self.host64)
        self.dev32.copy_(self.host32)
        self.cu_seqlens_q = torch.arange(top + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        with torch.no_grad():
            for bs in reversed(self.sizes):          # largest first: the others reuse its pool
                fb = self._batch(bs)
                model.hidden_states(self.ids[:bs], fb)   # warm-up: compiles kernels; pads write nothing
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, pool=pool):
                        self.outputs[bs] = model.hidden_states(self.ids[:bs], fb)
                except RuntimeError as exc:  # e.g. a host sync inside the forward
                    raise RuntimeError(f"CUDA graph capture of engine_decode (batch {bs}) failed: {exc}; every "
                                       "op of the decode forward must stay on the device (no .item(), no "
                                       "host copies); run with EngineConfig(cuda_graphs=False)") from exc
                pool = graph.pool()
                self.graphs[bs] = graph
        torch.cuda.synchronize()

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(case="engine_decode", positions=self.positions[:bs], kv=self.kv,
                            block_table=self.block_table[:bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
                            context_lens=self.context_lens[:bs], slot_mapping=self.slot_mapping[:bs],
                            max_seqlen_q=1, gdn_states=self.gdn_states, conv_states=self.conv_states,
                            state_slots=self.state_slots[:bs] if self.gdn_states is not None else None)

    def bucket(self, n: int) -> Optional[int]:
        return next((b for b in self.sizes if b >= n), None)

    def stage(self, n: int, ids, tables: list[list[int]], starts: list[int], page_size: int,
              state_slots: Optional[list[int]]) -> None:
        """Write a step's inputs into the pinned host buffers: n real lanes, the rest padded
        (id 0, position 0, slot -1: never writes the cache; one key on page 0: only reads)."""
        top, width = len(self.context_lens), self.width
        h64 = self.host64.numpy()
        h32 = self.host32.numpy()
        ids_h, pos_h, slot_h = h64[:top], h64[top:2 * top], h64[2 * top:]
        bt = h32[:top * width].reshape(top, width)
        ctx_h, st_h = h32[top * width:top * width + top], h32[top * width + top:]
        ids_h[:] = 0
        pos_h[:] = 0
        slot_h[:] = -1
        bt[:] = 0
        ctx_h[:] = 1
        st_h[:] = self.scratch_slot
        if n:
            ids_h[:n] = ids
            pos = np.asarray(starts, dtype=np.int64)
            pos_h[:n] = pos
            ctx_h[:n] = pos + 1
            for i, t in enumerate(tables):
                bt[i, :len(t)] = t
            page = bt[np.arange(n), pos // page_size].astype(np.int64)
            slot_h[:n] = page * page_size + pos % page_size
            if state_slots is not None:
                st_h[:n] = state_slots

    def run(self, ids, tables: list[list[int]], starts: list[int], page_size: int,
            state_slots: Optional[list[int]] = None) -> torch.Tensor:
        """Replay the bucket's graph; ``ids`` a list of ints, or an int64 device tensor (the
        previous step's samples, for a lookahead step: copied on the device, no host round trip)."""
        n = len(tables)
        bs = self.bucket(n)
        if self.copied is not None:     # the previous step's copy must have left the host buffers
            self.copied.synchronize()
        on_device = isinstance(ids, torch.Tensor)
        self.stage(n, [0] * n if on_device else ids, tables, starts, page_size, state_slots)
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)
        if on_device:
            self.ids[:n].copy_(ids)     # after the staging copy in stream order
        if self.copied is None:
            self.copied = torch.cuda.Event()
        self.copied.record()
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
