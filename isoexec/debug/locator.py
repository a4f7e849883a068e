"""First-divergence locator: which region first computes different bits for the same token.

Runs the same token sequence through the trainer side (``trainer_score`` over the packed
sequence) and the engine side (``engine_prefill`` in one chunk, or prefill of all but the last
token then ``engine_decode`` of the last one), records the output of every region call on both
sides, and compares them call by call through integer views, restricted to the rows both sides
computed. Both sides call the regions in the same order (the model code is shared), so the first
call that differs names the region and layer where the mismatch is born. Used by the RL loop's
live check to say where a differing logprob came from, and offline on saved sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..gates.compare import compare_bits
from ..model.batch import ForwardBatch, KVCache


@dataclass
class Divergence:
    call: int                 # index of the region call (0-based, in model order)
    region: str               # e.g. "k_proj+q_proj+v_proj"
    layer: Optional[int]      # decoder layer, when the call is inside one
    differing: int
    compared: int
    mode: str

    def __str__(self) -> str:
        where = f"layer {self.layer}, " if self.layer is not None else ""
        return (f"first divergence at {where}region {self.region} (call {self.call}, {self.mode}): "
                f"{self.differing}/{self.compared} elements differ")


class _Recorder:
    """Wraps every bound callable of a plan; keeps the output of each call in order."""

    def __init__(self, plan):
        self.plan = plan
        self.calls: list[tuple[str, torch.Tensor]] = []
        self.saved = dict(plan.by_op)

    def __enter__(self):
        wrapped: dict[int, object] = {}
        for op, bound in self.saved.items():
            if id(bound) not in wrapped:
                region = "+".join(sorted(o for o, b in self.saved.items() if b is bound))
                wrapped[id(bound)] = self._wrap(bound, region)
            self.plan.by_op[op] = wrapped[id(bound)]
        return self

    def _wrap(self, bound, region: str):
        calls = self.calls

        def call(*args, **kwargs):
            out = bound(*args, **kwargs)
            calls.append((region, out.detach().clone() if isinstance(out, torch.Tensor) else out))
            return out

        return call

    def __exit__(self, *exc):
        self.plan.by_op.clear()
        self.plan.by_op.update(self.saved)


def _layers(calls) -> list[Optional[int]]:
    """Layer index of each call: a new layer starts at each attn_norm call."""
    out, layer = [], None
    for region, _ in calls:
        if region == "attn_norm":
            layer = 0 if layer is None else layer + 1
        if region in ("final_norm", "lm_head", "logprob"):
            out.append(None)
        else:
            out.append(layer)
    return out


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    return t[rows] if t.dim() >= 1 else t


def first_divergence(trainer_model, engine_model, tokens: Sequence[int], mode: str = "prefill",
                     page_size: int = 16) -> Optional[Divergence]:
    """Compare trainer_score (trainer_model) with the engine case (engine_model) on ``tokens``.

    ``mode="prefill"``: one engine_prefill chunk of all tokens, every row compared.
    ``mode="decode"``: engine_prefill of tokens[:-1], then engine_decode of the last token; only
    the last row is compared. Returns None when every region call agrees bitwise."""
    if mode not in ("prefill", "decode"):
        raise ValueError(f"first_divergence: mode is prefill or decode, not {mode!r}")
    if len(tokens) < 2:
        raise ValueError("first_divergence: need at least 2 tokens")
    device = trainer_model.embed.device
    ids = torch.tensor(list(tokens), dtype=torch.int64, device=device)
    n = len(tokens)
    targets = torch.roll(ids, -1)
    with torch.no_grad():
        with _Recorder(trainer_model._plan("trainer_score")) as rec_t:
            h = trainer_model.hidden_states(ids, ForwardBatch.packed([n], "trainer_score", device))
            trainer_model.token_logprobs(h, targets, "trainer_score")
        cfg = engine_model.cfg
        pages = -(-n // page_size)
        kv = KVCache.allocate(cfg.num_layers, pages, page_size, cfg.num_kv_heads, cfg.head_dim,
                              engine_model.embed.dtype, device)
        table = [list(range(pages))]
        if mode == "prefill":
            with _Recorder(engine_model._plan("engine_prefill")) as rec_e:
                b = ForwardBatch.paged("engine_prefill", kv, table, [0], [n], device)
                h = engine_model.hidden_states(ids, b)
                engine_model.token_logprobs(h, targets, "engine_prefill")
            rows_t, rows_e = slice(0, n), slice(0, n)
        else:
            # the context's KV comes from a prefill: a divergence there shows up first
            with _Recorder(engine_model._plan("engine_prefill")) as rec_p:
                b = ForwardBatch.paged("engine_prefill", kv, table, [0], [n - 1], device)
                h = engine_model.hidden_states(ids[:-1], b)
                engine_model.token_logprobs(h, targets[:-1], "engine_prefill")
            found = _compare(rec_t.calls, rec_p.calls, slice(0, n - 1), slice(0, n - 1), "decode (context prefill)")
            if found:
                return found
            with _Recorder(engine_model._plan("engine_decode")) as rec_e:
                b = ForwardBatch.paged("engine_decode", kv, table, [n - 1], [1], device)
                h = engine_model.hidden_states(ids[-1:], b)
                engine_model.token_logprobs(h, targets[-1:], "engine_decode")
            rows_t, rows_e = slice(n - 1, n), slice(0, 1)
    return _compare(rec_t.calls, rec_e.calls, rows_t, rows_e, mode)


def _compare(calls_t, calls_e, rows_t: slice, rows_e: slice, mode: str) -> Optional[Divergence]:
    layers = _layers(calls_t)
    for i, ((ra, a), (rb, b_)) in enumerate(zip(calls_t, calls_e)):
        if ra != rb:
            raise RuntimeError(f"first_divergence: call {i} is {ra} on the trainer side but {rb} on the engine side")
        if not isinstance(a, torch.Tensor):
            continue
        rep = compare_bits(_rows(a, rows_t), _rows(b_, rows_e))
        if rep.differing:
            return Divergence(i, ra, layers[i], rep.differing, rep.compared, mode)
    return None
