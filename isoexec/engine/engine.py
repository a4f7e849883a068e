"""The rollout engine: requests in, token ids and their fp32 logprobs out.

    engine = Engine(model, contract, EngineConfig(...), trainer_contract=trainer.contract)
    results = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=256, seed=7))
    results[i].ids, results[i].logprobs, results[i].finish_reason

The model must already be installed with ``contract`` (``model.install(contract)``). On start,
and again on every weight update, the engine runs the contract handshake against the trainer's
contract and refuses a different ``numerical_policy`` (``isoexec.contract.receive``): a rollout
whose logprobs the trainer cannot reproduce bit for bit is refused before it is generated.

Staggered arrivals: ``add_request`` at any time, ``step()`` runs one scheduled step and returns
the requests that finished in it. ``generate`` is add + step until done, results in prompt order.

Decode lookahead (``EngineConfig.overlap_decode``): a decode step ends by reading its sampled
tokens to the host (a sync), and the next step's scheduling, staging and graph launch then run
while the device waits. With lookahead, once a decode step is launched the engine plans the next
decode step (``Scheduler.lookahead``: the same sequences minus those that reach their length
limit) and launches it at once, its input tokens copied on the device from the step still
running; only then does it read the first step's tokens and postprocess them. A sequence that
sampled a stop token in the first step was computed one token too far: that row is dropped and
its page freed with the rest. Weight updates drop a step planned ahead. The kernels are batch
invariant, so the tokens and logprobs are those of a run without lookahead (tested, dense and
hybrid); only which rows share a step changes. A dropped row of a recurrent family updates its
freed state slot, which the next sequence to take it zeroes first. Off by default (and never with
top-n logprobs or full-row recording) until its speed is measured on a GPU.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Optional, Sequence as Seq, Union

import torch
from torch import nn

from ..contract import ExecutionContract, HandshakeResult, offer, receive
from ..dist.lazy_parameters import shape_of
from ..errors import BindingRefused
from .block_manager import BlockManager
from .config import EngineConfig
from .model_runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Result, SamplingParams, Sequence


@dataclass(frozen=True)
class Progress:
    """A snapshot handed to ``on_progress`` after every step."""

    step: int
    finished: int          # requests finished (in this generate call, or since start for step())
    total: int             # requests in this generate call (0 outside generate)
    running: int
    waiting: int
    generated_tokens: int  # tokens sampled since the engine started
    preemptions: int
    elapsed_s: float

    def line(self) -> str:
        rate = self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0
        done = f"{self.finished}/{self.total}" if self.total else str(self.finished)
        return (f"isoexec engine: step {self.step} | done {done} | running {self.running} waiting {self.waiting} "
                f"| {self.generated_tokens} tok, {rate:.1f} tok/s | preemptions {self.preemptions}")


def contract_page_size(contract: ExecutionContract) -> Optional[int]:
    """PAGE_SIZE of the contract's ``kv_pages`` deployment entry, if it has one."""
    for e in contract.composition:
        if tuple(e.region) == ("kv_pages",) and "PAGE_SIZE" in e.constants:
            return int(e.constants["PAGE_SIZE"])
    return None


TrainerContract = Union[ExecutionContract, bytes]


class Engine:
    def __init__(self, model, contract: ExecutionContract, config: Optional[EngineConfig] = None,
                 trainer_contract: Optional[TrainerContract] = None):
        installed = getattr(model, "contract", None)
        if installed is None:
            raise BindingRefused("Engine: the model has no contract installed; call model.install(contract) first")
        if installed.identities.numerical_policy != contract.identities.numerical_policy:
            raise BindingRefused(
                f"Engine: the model is installed with numerical_policy {installed.identities.numerical_policy[:12]}… "
                f"but the engine was given {contract.identities.numerical_policy[:12]}…; install the engine's "
                "contract on the model")
        config = config or EngineConfig()
        page_size = config.page_size or contract_page_size(contract) or 16
        max_model_len = config.max_model_len or model.cfg.max_position_embeddings
        self.config = replace(config, page_size=page_size, max_model_len=max_model_len)
        self.model = model
        self.contract = contract
        # recurrent families need one state slot per running sequence: default to max_num_seqs
        slots = config.num_state_slots or (config.max_num_seqs if hasattr(model, "allocate_recurrent_state") else 0)
        self.config = replace(self.config, num_state_slots=slots)
        self.block_manager = BlockManager(config.num_pages, page_size, slots)
        self.runner = ModelRunner(model, config.num_pages, page_size, max_model_len, config.max_num_seqs,
                                  cuda_graphs=config.cuda_graphs, graph_batch_sizes=config.decode_buckets(),
                                  num_state_slots=slots, record_full_logprobs=config.record_full_logprobs)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.chunk_align, max_model_len,
                                   config.effective_prefill_interval(self.runner.graphs is not None))
        self.handshake_result: Optional[HandshakeResult] = None
        self._trainer_offer: Optional[bytes] = None
        self.weight_version = 0
        self.num_steps = 0
        self.num_generated = 0
        self.num_finished = 0
        self._live: dict[int, Sequence] = {}
        self._next_id = 0
        self._ahead: Optional[tuple] = None      # (lookahead batch, its launched output)
        self.num_ahead_steps = 0                 # decode steps launched ahead (overlap_decode)
        self.num_ahead_dropped = 0               # rows computed ahead for a sequence that had stopped
        self._t0 = time.perf_counter()
        if trainer_contract is not None:
            self.handshake(trainer_contract)

    # ------------------------------------------------------------------------------ contract
    def handshake(self, trainer_contract: TrainerContract) -> HandshakeResult:
        """Accept the trainer's contract or raise ContractMismatch (numerical_policy differs)."""
        remote = trainer_contract if isinstance(trainer_contract, bytes) else offer(trainer_contract)
        result = receive(self.contract, remote, local_name="engine", remote_name="trainer")
        self.handshake_result = result
        self._trainer_offer = remote
        return result

    # ------------------------------------------------------------------------------ requests
    def add_request(self, prompt: Seq[int], params: Optional[SamplingParams] = None,
                    request_id: Optional[int] = None) -> int:
        """Queue a request; returns its id (the sampler's key with the seed and position)."""
        params = params or SamplingParams()
        if request_id is None:
            while self._next_id in self._live:
                self._next_id += 1
            request_id = self._next_id
            self._next_id += 1
        if not 0 <= request_id < 2 ** 63:
            raise ValueError(f"request id must be in [0, 2**63), got {request_id}")
        if request_id in self._live:
            raise ValueError(f"request id {request_id} is already live; ids must be unique among live requests")
        prompt = [int(t) for t in prompt]
        V = self.model.cfg.vocab_size
        if any(not 0 <= t < V for t in prompt):
            raise ValueError(f"request {request_id}: prompt token ids must be in [0, {V})")
        cfg = self.config
        if len(prompt) >= cfg.max_model_len:
            raise ValueError(f"request {request_id}: prompt of {len(prompt)} tokens leaves no room under "
                             f"max_model_len {cfg.max_model_len}")
        longest = min(len(prompt) + params.max_tokens, cfg.max_model_len)
        if self.block_manager.pages_for(longest) > cfg.num_pages:
            raise ValueError(f"request {request_id}: up to {longest} tokens need "
                             f"{self.block_manager.pages_for(longest)} pages of {cfg.page_size}, the cache has "
                             f"{cfg.num_pages}; raise num_pages or lower max_tokens")
        seq = Sequence(request_id, prompt, params)
        self._live[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Result]:
        """Run one scheduled step; the requests that finished in it."""
        if self._ahead is not None:                 # launched during the previous call
            batch, out = self._take_ahead()
        else:
            batch = self.scheduler.schedule()
            if batch is None:
                return []
            out = self.runner.run(batch)
        if batch.seqs and out is not None and self._may_look_ahead(batch):
            self._launch_ahead(batch, out)
        if out is None:
            tokens, lps, tops = [], [], None
        else:
            tokens, lps, tops = out.tokens.tolist(), out.logprobs.tolist(), out.top
        finished = self.scheduler.postprocess(batch, tokens, lps, tops)
        if self._ahead is not None and all(s.is_finished for s in self._ahead[0].seqs):
            self.num_ahead_dropped += len(self._ahead[0].seqs)   # every one stopped: nothing to keep
            self._ahead = None
        self.num_steps += 1
        self.num_generated += len(tokens)
        self.num_finished += len(finished)
        for s in finished:
            del self._live[s.request_id]
        if self.config.log_every and self.num_steps % self.config.log_every == 0:
            print(self.progress().line(), file=sys.stderr, flush=True)
        return [s.result() for s in finished]

    def _may_look_ahead(self, batch) -> bool:
        """Lookahead applies: asked for, a decode step, and nothing that reads the step's
        results on the host before its tokens (top-n logprobs) or keeps per-position records
        (full-row recording)."""
        return (self.config.overlap_decode and batch.is_decode
                and self.runner.full_rows is None and not any(s.params.logprobs for s in batch.seqs))

    def _take_ahead(self):
        """The step launched ahead, without the rows of sequences that sampled a stop token in
        the step before it (their next token was computed anyway; the rows are dropped on the
        device, no sync)."""
        batch, out = self._ahead
        self._ahead = None
        keep = [i for i, s in enumerate(batch.seqs) if not s.is_finished]
        if len(keep) < len(batch.seqs):
            self.num_ahead_dropped += len(batch.seqs) - len(keep)
            idx = torch.tensor(keep, dtype=torch.int64).to(out.tokens.device, non_blocking=True)
            batch = replace(batch, seqs=[batch.seqs[i] for i in keep], num_tokens=[1] * len(keep))
            out = replace(out, tokens=out.tokens[idx], logprobs=out.logprobs[idx])
        return batch, out

    def _launch_ahead(self, batch, out) -> None:
        """Plan and launch the decode step after ``batch`` before its tokens are read; its
        inputs are the rows of ``out.tokens`` of the sequences that go on."""
        nxt = self.scheduler.lookahead(batch)
        if nxt is None:
            return
        ids = out.tokens
        if len(nxt.seqs) < len(batch.seqs):      # nxt.seqs is a subsequence of batch.seqs
            row = {id(s): i for i, s in enumerate(batch.seqs)}
            pick = torch.tensor([row[id(s)] for s in nxt.seqs], dtype=torch.int64)
            ids = out.tokens[pick.to(out.tokens.device, non_blocking=True)]
        self._ahead = (nxt, self.runner.run(nxt, ahead_ids=ids))
        self.num_ahead_steps += 1

    def progress(self, finished: Optional[int] = None, total: int = 0) -> Progress:
        return Progress(self.num_steps, self.num_finished if finished is None else finished, total,
                        len(self.scheduler.running), len(self.scheduler.waiting), self.num_generated,
                        self.scheduler.num_preemptions, time.perf_counter() - self._t0)

    def generate(self, prompts: Seq[Seq[int]],
                 sampling: Union[SamplingParams, Seq[SamplingParams], None] = None,
                 request_ids: Optional[Seq[int]] = None,
                 on_progress: Optional[Callable[[Progress], None]] = None) -> list[Result]:
        """Generate for every prompt; results in prompt order. Request ids default to 0..N-1, so
        the same call with the same seeds gives the same tokens. The engine must be idle."""
        if self.has_unfinished():
            raise RuntimeError("generate: the engine still has requests from add_request; drain them with step()")
        n = len(prompts)
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling or SamplingParams()] * n
        if len(params) != n:
            raise ValueError(f"generate: {n} prompts but {len(params)} SamplingParams")
        ids = list(request_ids) if request_ids is not None else list(range(n))
        if len(ids) != n or len(set(ids)) != n:
            raise ValueError("generate: request_ids must be unique, one per prompt")
        for p, sp, rid in zip(prompts, params, ids):
            self.add_request(p, sp, rid)
        results: dict[int, Result] = {}
        while self.has_unfinished():
            for r in self.step():
                results[r.request_id] = r
            if on_progress is not None:
                on_progress(self.progress(len(results), n))
        if self.config.log_every:
            print(self.progress(len(results), n).line(), file=sys.stderr, flush=True)
        return [results[i] for i in ids]

    # ------------------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, weights: Union[Mapping[str, torch.Tensor], nn.Module],
                       trainer_contract: Optional[TrainerContract] = None) -> HandshakeResult:
        """Copy new weights into the model's existing parameters (in place: captured graphs stay
        valid), after the handshake with the trainer's contract (given here or the one accepted
        last). Every live request loses its KV and recurrent state and is recomputed with the new
        weights (its tokens so far keep the logprobs they were sampled with)."""
        remote = trainer_contract if trainer_contract is not None else self._trainer_offer
        if remote is None:
            raise ValueError("update_weights: no trainer contract to handshake with; pass trainer_contract")
        result = self.handshake(remote)                  # refuses before anything changes
        # a mapping is read name by name below and not copied: a lazily gathered one (a sharded
        # trainer's gathered_parameters) then holds one whole parameter at a time
        src = dict(weights.named_parameters()) if isinstance(weights, nn.Module) else weights
        if hasattr(self.model, "shard_weights"):         # a tensor-parallel model: its rank's shards
            src = self.model.shard_weights(src)
        params = dict(self.model.named_parameters())
        missing, extra = sorted(set(params) - set(src)), sorted(set(src) - set(params))
        if missing or extra:
            raise ValueError(f"update_weights: parameter names differ (missing {missing[:5]}, unexpected "
                             f"{extra[:5]})")
        for name, p in params.items():                   # shapes first, without reading a value
            if shape_of(src, name) != tuple(p.shape):
                raise ValueError(f"update_weights: {name} has shape {shape_of(src, name)}, the model "
                                 f"{tuple(p.shape)}")
        self._ahead = None                               # a step planned ahead ran on the old weights
        self.scheduler.preempt_all()                     # KV (and recurrent state) are stale now
        self.runner.reset_state(None)                    # every recurrent-state slot starts from zero
        for name, p in params.items():
            p.copy_(src[name])                           # read, copied, dropped: one at a time
        self.weight_version += 1
        return result
