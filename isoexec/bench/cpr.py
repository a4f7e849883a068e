"""CPR per-layer latency: the Gated DeltaNet core of one layer, ours (CPR) vs the two stock
compositions, in the same run on the same inputs (docs/benchmarks.md, seed table "CPR per-layer
latency vs native mixed and recurrent-everywhere").

Stages (Qwen3.5 GDN dimensions: 16 q/k heads, 32 value heads, head dim 128, chunk 64):
  trainer_fwd_bwd   varlen forward + backward, 5 sequences x 2048 tokens (10,240 tokens)
  prefill           engine prefill of 5 fresh sequences x 2048 tokens (state written), the layout
                    given on the host as the engine gives it (``gdn_core.HostPlan``)
  decode            one token for each of 256 sequences that already hold context state (random
                    chunk fill, so about 256/64 lanes resynchronise per step, as in steady state)

Baselines (``isoexec_kernels/gdn_core/native.py``):
  native_mixed          chunk algorithm for trainer and prefill, fused recurrent step for decode
  recurrent_everywhere  the per-token recurrence for every stage
Ours: CPR version 4 (``CPR_IMPL``: ``gdn_cpr_chunk``, ``gdn_cpr4_varlen`` / ``gdn_cpr4_engine`` /
``gdn_cpr4_decode``; its engine state keeps the open chunk's values in their bf16, as the hybrid model
allocates it), the version the IsoExec compositions bind for both GDN families (version 3 is
``gdn_cpr``); the table names the impl it timed.

Only the core is timed (inputs q, k fp32 L2-normalised, v bf16 on CUDA / fp32 on CPU, g, beta
fp32; projections, conv and norms are the same for every variant and left out). Decode runs
under a CUDA graph on GPU (the engine captures decode), trainer and prefill eagerly. CPR's trainer
backward is the gradient of its chunk form recomputed (``api.chunk_form_varlen``); native mixed takes
its own WY backward on CUDA (``native_wy_backward.py``, stock rounding), as a stock stack would.
One row per (stage, baseline): ``baseline_ms``, ``ours_ms``,
``speed_ratio = baseline_ms / ours_ms``, and ``overhead_vs_native = ours_ms / native_mixed_ms``
(the seed reports overheads: CPR 1.43x / 1.67x / 1.38x; recurrent-everywhere 4.42x / 4.31x /
1.00x). The decode rows also give the step's memory floor (:func:`decode_floor`): the state bytes a
step cannot avoid over the copy bandwidth measured in the same run. ``quick=True``: tiny shapes
that run on CPU in seconds (ratios only mean something on the GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from isoexec_kernels import gdn_core as cpr
from isoexec_kernels.gdn_core import GDNState
from isoexec_kernels.gdn_core import native as nat

from ..envinfo import env_info
from .common import print_rows, row, time_ms

GDN_DIMS = dict(Hk=16, H=32, Dk=128, Dv=128, chunk=64)
FULL = dict(train=(5, 2048), prefill=(5, 2048), decode=256)
QUICK_DIMS = dict(Hk=2, H=4, Dk=16, Dv=16, chunk=16)
QUICK = dict(train=(2, 48), prefill=(2, 48), decode=8)
CPR_IMPL = "gdn_cpr_chunk"
"""The impl timed as ours (named in every row)."""


def _inputs(lens, dims, device, v_dtype, seed, requires_grad=False):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    T = sum(lens)
    Hk, H, Dk, Dv = dims["Hk"], dims["H"], dims["Dk"], dims["Dv"]
    k = F.normalize(torch.randn(T, Hk, Dk, generator=gen), dim=-1)
    q = F.normalize(torch.randn(T, Hk, Dk, generator=gen), dim=-1) * Dk ** -0.5
    v = torch.randn(T, H, Dv, generator=gen).to(v_dtype)
    g = -torch.rand(T, H, generator=gen) * 0.3  # log decay
    beta = torch.rand(T, H, generator=gen)
    xs = [x.to(device).requires_grad_(requires_grad) for x in (q, k, v, g, beta)]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return xs, cu


def _decode_state(B, dims, device, seed, chunk_form=False, value_dtype=torch.float32):
    """A state of B + 1 slots with random contents and fills (so about B / C lanes complete a chunk
    per step); ``chunk_form``: CPR version 4's (values kept in ``value_dtype``, its bf16 copies
    made where the values are not fp32)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    C = dims["chunk"]
    st = GDNState.allocate(B + 1, dims["H"], dims["Dk"], dims["Dv"], device, chunk=C, with_q=chunk_form,
                           value_dtype=value_dtype)
    for name in ("boundary", "running", "buf_k", "buf_v") + (("buf_q", "buf_vn", "buf_T") if chunk_form else ()):
        t = getattr(st, name)
        t.copy_((torch.randn(t.shape, generator=gen) * 0.05).to(device))
    if st.boundary_op is not None:   # bf16 values: the state keeps bf16 operand copies (fp32 values: none)
        st.boundary_op.copy_(st.boundary)
        st.buf_vn_op.copy_(st.buf_vn)
    st.buf_g.copy_((-torch.rand(st.buf_g.shape, generator=gen) * 0.3).to(device))
    st.buf_beta.copy_(torch.rand(st.buf_beta.shape, generator=gen).to(device))
    st.fill.copy_(torch.randint(0, C, (B + 1,), generator=gen, dtype=torch.int32).to(device))
    return st


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Device copy bandwidth in bytes per second, read + write counted (``dst.copy_(src)`` of
    ``nbytes``, timed like the stages)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src), device, rep_ms=60)
    return 2 * src.numel() * 4 / (t * 1e-3)


def decode_floor(native_state: GDNState, cpr_state: GDNState, lanes: int, bandwidth: float) -> dict:
    """What one decode step of the first ``lanes`` slots must read or write at least once, and that
    over ``bandwidth``: a lower bound (the token's own inputs, the kept rows of T and, for CPR, the
    boundary written where a chunk completes come on top; the kernels may read a row twice).
    Native: the running state read and written back. CPR (the chunk form): the boundary once, as the
    operand its dots take (the bf16 copy where the state keeps one, else the fp32 boundary), and
    the open chunk's rows so far (the slots' fill plus the token) of k, v and Vn (its bf16 copy where
    kept), in the buffers' own dtypes: row t of the chunk form reads every earlier row's k (T), v (U)
    and Vn (the output)."""
    per_lane = native_state.running[0].numel()
    cpr_op = cpr_state.boundary_op if cpr_state.boundary_op is not None else cpr_state.boundary
    vn = cpr_state.buf_vn_op if cpr_state.buf_vn_op is not None else cpr_state.buf_vn
    H, Dk, Dv = cpr_state.buf_k.shape[2], cpr_state.buf_k.shape[3], cpr_state.buf_v.shape[3]
    rows = int((cpr_state.fill[:lanes].long() + 1).sum())
    row_bytes = H * (Dk * cpr_state.buf_k.element_size() + Dv * (cpr_state.buf_v.element_size() + vn.element_size()))
    native_bytes = 2 * lanes * per_lane * native_state.running.element_size()
    state_bytes = lanes * per_lane * cpr_op.element_size()
    cpr_bytes = state_bytes + rows * row_bytes
    return {"copy_gb_s": round(bandwidth / 1e9, 1), "native_state_bytes": native_bytes,
            "cpr_state_bytes": state_bytes, "cpr_open_rows": rows, "cpr_bytes": cpr_bytes,
            "native_floor_ms": round(native_bytes / bandwidth * 1e3, 5),
            "cpr_state_floor_ms": round(state_bytes / bandwidth * 1e3, 5),
            "cpr_floor_ms": round(cpr_bytes / bandwidth * 1e3, 5)}


def _graphed(fn, device):
    """On CUDA: capture ``fn`` in a CUDA graph (after a warm-up call) and return its replay."""
    if device != "cuda":
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench_cpr_rows(device: str = "cuda", quick: bool = False, log=print) -> list[dict]:
    """The rows of :func:`bench_cpr` (one per (stage, baseline))."""
    dims = QUICK_DIMS if quick else GDN_DIMS
    sizes = QUICK if quick else FULL
    C = dims["chunk"]
    v_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rep_ms = 30 if quick else 200
    common = {"heads_qk": dims["Hk"], "heads_v": dims["H"], "head_dim": dims["Dk"], "chunk": C,
              "v_dtype": str(v_dtype).replace("torch.", "")}
    rows = []

    def emit(fields, t_native, t_recurrent, t_ours):
        for name, t in (("native_mixed", t_native), ("recurrent_everywhere", t_recurrent)):
            r = row({**fields, **common, "impl": CPR_IMPL}, name, t, t_ours)
            r["overhead_vs_native"] = round(t_ours / t_native, 4) if t_native > 0 else None
            rows.append(r)
            print_rows([r], ["stage", "batch", "seqlen"], log)

    # trainer forward + backward
    b, L = sizes["train"]
    xs, cu = _inputs([L] * b, dims, device, v_dtype, seed=1, requires_grad=True)
    do = torch.randn(b * L, dims["H"], dims["Dv"], device=device)

    def train(fn):
        def run():
            o = fn(*xs, cu, chunk=C)
            torch.autograd.grad(o, xs, do)
        return run

    t = [time_ms(train(f), device, rep_ms=rep_ms)
         for f in (nat.gdn_chunk_varlen, nat.gdn_recurrent_varlen, cpr.gdn_cpr4_varlen)]
    emit({"stage": "trainer_fwd_bwd", "batch": b, "seqlen": L, "tokens": b * L}, *t)
    del xs, do

    # rollout prefill of fresh sequences (after a multiple of C tokens a CPR slot is back on a
    # boundary, so every repetition takes the same path; the native state just keeps evolving)
    b, L = sizes["prefill"]
    xs, cu = _inputs([L] * b, dims, device, v_dtype, seed=2)
    slots = torch.arange(b, device=device)

    # the layout on the host, as the engine's batches give it (HostPlan: no readbacks). The slots
    # count as fresh: what matters is each open chunk's fill, which every repetition leaves at 0
    host = cpr.HostPlan.of([L] * b, range(b), [0] * b)

    def prefill(fn, chunk_form=False):
        st = cpr.GDNState.allocate(b, dims["H"], dims["Dk"], dims["Dv"], device, chunk=C, with_q=chunk_form,
                                   value_dtype=v_dtype)
        return lambda: fn(*xs, cu, slots, st, chunk=C, host=host)

    with torch.no_grad():
        t = [time_ms(prefill(f, f is cpr.gdn_cpr4_engine), device, rep_ms=rep_ms)
             for f in (nat.gdn_chunk_engine, nat.gdn_recurrent_engine, cpr.gdn_cpr4_engine)]
    emit({"stage": "prefill", "batch": b, "seqlen": L, "tokens": b * L, "host_plan": True}, *t)
    del xs

    # decode: one token for B sequences with context state
    B = sizes["decode"]
    xs, _ = _inputs([B], dims, device, v_dtype, seed=3)
    slots = torch.arange(B, device=device)

    states = {}

    def decode(fn, chunk_form=False):
        st = states[chunk_form] = _decode_state(B, dims, device, seed=4, chunk_form=chunk_form, value_dtype=v_dtype)
        return _graphed(lambda: fn(*xs, slots, st, chunk=C), device)

    with torch.no_grad():
        t_native = time_ms(decode(nat.gdn_recurrent_decode), device, rep_ms=rep_ms)
        t_ours = time_ms(decode(cpr.gdn_cpr4_decode, chunk_form=True), device, rep_ms=rep_ms)
    # a copy of 1 GiB on the GPU (past its L2, as the 256 lanes' states are), 64 MiB on a CPU
    floor = decode_floor(states[False], states[True], B, copy_bandwidth(device, 64 << 20 if quick or device == "cpu"
                                                                        else 1 << 30))
    # both stock compositions decode with the same fused recurrent step: one measurement
    emit({"stage": "decode", "batch": B, "seqlen": 1, "tokens": B, "graphs": device == "cuda", **floor},
         t_native, t_native, t_ours)
    return rows


def bench_cpr(quick: bool = False, device: str = "cuda", log=print) -> dict:
    """Run the CPR per-layer benchmark; returns the docs/benchmarks.md result object
    ``{"name": "cpr", "env": {...}, "rows": [...]}`` (the caller writes it to
    ``results/<run>/bench/cpr.json``)."""
    rows = bench_cpr_rows(device, quick, log)
    env = env_info("cpu" if device == "cpu" else None)
    env = {k: env[k] for k in ("device", "torch", "triton", "transformers", "commit", "date")}
    return {"name": "cpr", "env": env, "rows": rows}
