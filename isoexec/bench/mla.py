"""MLA attention rows of ``isoexec bench moe``: the mla_moe family's attention, IsoExec vs stock.

The attention is the ``attn_core`` region of the mla_moe contract, bound from the shipped
compositions and called with the arguments ``MlaMoeModel._mla_attention``
(``isoexec/model/mla_moe.py``) passes in each case: ``mla_expanded_walk`` for isoexec (per-head
q/k/v zero-padded to the attention width W on the fixed-walk attention) and ``torch_mla_sdpa``
for native (the same expansion and padding on the stock attention: on a GPU FlashAttention-2
varlen over the packed rows, in the engine after a gather of each sequence's pages; padded SDPA
on a CPU). Both sides see the same random inputs in the same run.

Dimensions come from the shipped model configs: ``mla_moe_glm47_flash_dims`` on a GPU (GLM-4.7-Flash:
20 heads, q/k head 192 no-rope + 64 rope = 256, v head 256, W 256, scale 256 ** -0.5) and
``mla_moe_tiny`` on a CPU or with ``--quick`` (4 heads, q/k 8 + 8, v 8, W 16, so the value side
is padded). The latent ranks (q 768, kv 512) do not reach this region: the model expands the
latent before it (``expand_qkv``), and what enters the attention, and what the engine caches, are
the expanded per-head rows. Inputs are the expanded q/k/v (trainer) or q and a random paged cache
of padded rows whose padding columns are zero, as ``write_mla_kv_pages`` leaves them (engine).

Rows: ``stage`` ``mla.<shape>.<trainer|prefill|decode>.<pass>``, ``case`` the plan's case,
``impl`` / ``baseline_impl`` the implementations the two plans bound, ``baseline: "torch"`` (the
native composition), ``M`` the query rows, and ``heads``, ``qk_head_dim``, ``v_head_dim``,
``attn_width``, ``dtype``, ``timing`` as in the MoE rows:

* ``trainer.fwd`` / ``trainer.fwd+bwd``: packed causal varlen attention of ``batch`` sequences of
  ``seqlen`` tokens (8 x 512 and 2 x 4096 on a GPU, the MoE rows' 4096 and 8192 training tokens):
  the forward under the trainer's scoring plan without autograd (case ``trainer_score``), and the
  forward + backward under its training plan (``trainer_fwd``; ``torch.autograd.grad`` w.r.t. q, k
  and v, a fixed upstream gradient).
* ``prefill.fwd``: the engine's chunked prefill over the paged cache, each sequence one chunk of
  ``seqlen`` queries over its ``seqlen`` keys, at the trainer's sizes (``engine_prefill``).
* ``decode.fwd``: one query per sequence over ``context`` cached keys (64 x 2048 and 64 x 8192 on a
  GPU; ``engine_decode``), under CUDA graphs on CUDA as the engine decodes (eager times beside them).

Pages hold ``PAGE_SIZE`` tokens of the contract's ``kv_pages`` entry. The page write of the new
tokens (``write_mla_kv_pages``, a pad and a copy that the model runs before the region, the same
function in both compositions) is not timed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..compose import load_model_config
from ..engine.engine import contract_page_size
from ..envinfo import runtime_arch
from ..model_config import MlaMoeConfig
from .common import (
    COMPOSITIONS,
    composition_plan,
    fwd_bwd,
    leaf,
    print_rows,
    random_paged_kv,
    rotating,
    row,
    time_compositions,
)

FAMILY = "mla_moe"
# (batch, seqlen) of the trainer and prefill rows, (batch, context) of the decode rows
TRAIN, DECODE = ((8, 512), (2, 4096)), ((64, 2048), (64, 8192))
QUICK_TRAIN, QUICK_DECODE = ((2, 32),), ((4, 64),)


@dataclass(frozen=True)
class MlaShape:
    """The attention dimensions of one model config (``MlaMoeConfig``)."""

    name: str
    heads: int
    qk_head_dim: int    # qk_nope_head_dim + qk_rope_head_dim
    v_head_dim: int
    width: int          # attn_width: q/k/v padded to it, the width of a page row

    @classmethod
    def from_config(cls, name: str, config: str) -> "MlaShape":
        cfg = MlaMoeConfig.from_hf(load_model_config(config)["hf_config"])
        return cls(name, cfg.num_heads, cfg.qk_head_dim, cfg.v_head_dim, cfg.attn_width)

    @property
    def scale(self) -> float:
        return self.qk_head_dim ** -0.5    # as MlaMoeModel._mla_attention


def mla_shape(big: bool) -> MlaShape:
    return MlaShape.from_config("glm47_flash", "mla_moe_glm47_flash_dims" if big else "mla_moe_tiny")


CASES = ("trainer_score", "trainer_fwd", "engine_prefill", "engine_decode")


def mla_regions(arch: str) -> tuple[dict, int]:
    """``({(composition, case): the bound attn_core}, page size)`` of the mla_moe contracts on
    ``arch``; the page size is the ``kv_pages`` PAGE_SIZE, which both compositions must pin alike."""
    plans = {(c, case): composition_plan(FAMILY, c, arch, case) for c in COMPOSITIONS for case in CASES}
    pages = {contract_page_size(plans[c, "engine_decode"].contract) for c in COMPOSITIONS}
    if len(pages) != 1 or None in pages:
        raise ValueError(f"bench moe (mla): the compositions' kv_pages PAGE_SIZE differ or are missing: {pages}")
    return {key: plan["attn_core"] for key, plan in plans.items()}, pages.pop()


def mla_attention(fn, s: MlaShape, case: str, q: torch.Tensor, kv: tuple, cu_seqlens, max_seqlen: int):
    """The bound ``attn_core`` ``fn`` called with the arguments ``MlaMoeModel._mla_attention`` passes
    in ``case``. ``kv`` is (k, v) in the trainer's cases and (k_cache, v_cache, block_table,
    context_lens) in the engine's; ``cu_seqlens`` / ``max_seqlen`` are the packed sequences' (trainer)
    or the query chunks' (prefill) bounds and are not used by decode."""
    if case in ("trainer_fwd", "trainer_score"):
        return fn(q, *kv, cu_seqlens, max_seqlen, s.scale)
    if case == "engine_decode":
        return fn(q, *kv, s.scale, v_dim=s.v_head_dim)
    kc, vc, bt, lens = kv
    return fn(q, kc, vc, bt, cu_seqlens, lens, s.scale, max_seqlen_q=max_seqlen, v_dim=s.v_head_dim)


def mla_paged_kv(s: MlaShape, batch: int, context: int, page_size: int, device: str, dtype: torch.dtype) -> tuple:
    """A random paged cache of ``batch`` sequences of ``context`` expanded K/V rows, W wide, with
    zero padding columns as ``write_mla_kv_pages`` leaves them: (k_cache, v_cache, block_table,
    context_lens)."""
    kc, vc, bt, lens = random_paged_kv(batch, context, page_size, s.heads, s.width, device, dtype)
    kc[..., s.qk_head_dim:] = 0
    vc[..., s.v_head_dim:] = 0
    return kc, vc, bt, lens


def bench_mla(device: str, quick: bool = False, log=print) -> list[dict]:
    """The MLA attention rows (module docstring); ``bench_moe`` appends them to its MoE rows."""
    big = device == "cuda" and not quick
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    arch = "cpu" if device == "cpu" else runtime_arch()
    train, decode = (TRAIN, DECODE) if big else (QUICK_TRAIN, QUICK_DECODE)
    reps = dict(rep_ms=0, min_reps=1) if not big else {}   # quick and CPU runs: a format check
    s = mla_shape(big)
    attn, page = mla_regions(arch)
    fields = {"heads": s.heads, "qk_head_dim": s.qk_head_dim, "v_head_dim": s.v_head_dim, "attn_width": s.width,
              "dtype": str(dtype).replace("torch.", "")}
    rows = []

    def timed(stage: str, case: str, shape: dict, make_run, graphs: bool = False) -> None:
        t, extra = time_compositions(make_run, device, graphs, **reps)
        r = row({"stage": f"mla.{s.name}.{stage}", "pass": stage.rsplit(".", 1)[1], "case": case, **shape, **fields,
                 "impl": attn["isoexec", case].record.impl_id, "baseline_impl": attn["native", case].record.impl_id,
                 **extra}, "torch", t["native"], t["isoexec"])
        rows.append(r)
        print_rows([r], ["stage", "M", "batch", "seqlen", "context", "heads", "attn_width"], log)

    def rnd(t: int, d: int) -> torch.Tensor:
        return torch.randn(t, s.heads, d, device=device, dtype=dtype)

    def forward(case: str, nxt, cu, max_seqlen: int, kv=None):
        """make_run for a forward without autograd: inputs (q, k, v) from ``nxt`` (trainer), or q
        from ``nxt`` over the cache ``kv`` (engine)."""
        def make_run(c):
            fn = attn[c, case]

            def run():
                x = nxt()
                with torch.no_grad():
                    return mla_attention(fn, s, case, x[0], x[1:] if kv is None else kv, cu, max_seqlen)
            return run
        return make_run

    for b, n in train:
        T = b * n
        cu = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=device)
        shape = {"M": T, "batch": b, "seqlen": n}
        timed("trainer.fwd", "trainer_score", shape,
              forward("trainer_score", rotating(lambda: (rnd(T, s.qk_head_dim), rnd(T, s.qk_head_dim),
                                                         rnd(T, s.v_head_dim)), 3), cu, n))

        def train_fn(c, cu=cu, n=n):
            fn = attn[c, "trainer_fwd"]
            return lambda q, k, v: mla_attention(fn, s, "trainer_fwd", q, (k, v), cu, n)

        qkv = (leaf(rnd(T, s.qk_head_dim)), leaf(rnd(T, s.qk_head_dim)), leaf(rnd(T, s.v_head_dim)))
        runs = {c: fwd_bwd(train_fn(c), qkv, rnd(T, s.v_head_dim)) for c in COMPOSITIONS}
        timed("trainer.fwd+bwd", "trainer_fwd", shape, runs.__getitem__)
        del runs, qkv
        # the engine's prefill of the same sequences, each one chunk over its own pages
        kv = mla_paged_kv(s, b, n, page, device, dtype)
        timed("prefill.fwd", "engine_prefill", {**shape, "context": n, "page_size": page},
              forward("engine_prefill", rotating(lambda: (rnd(T, s.qk_head_dim),), 3), cu, n, kv))
        del kv
    for b, ctx in decode:
        kv = mla_paged_kv(s, b, ctx, page, device, dtype)
        timed("decode.fwd", "engine_decode", {"M": b, "batch": b, "context": ctx, "page_size": page},
              forward("engine_decode", rotating(lambda: (rnd(b, s.qk_head_dim),), 3), None, 1, kv),
              graphs=device == "cuda")
        del kv
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows
