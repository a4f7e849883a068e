"""The MoE layer cut into the contract's regions (isoexec_kernels/moe/regions.py and the stock
regions of native.py): run in sequence, the regions give the whole-layer twins' bits; the stock
regions are transformers' grouped_mm path (stable expert sort, torch._grouped_mm, a weighted sum
per token), computing the eager loop's layer, with no host synchronisation, and falling back to
the loop for operands torch._grouped_mm refuses; the router computes the Qwen-style shared-expert
gate; every CPU path of both experts regions gives the stacked weights a whole gradient, zeros where
no row reached them, a dispatch of no row included. The tests marked gpu capture the stock regions (and the native mla_moe engine's decode
steps) in CUDA graphs."""

import pytest
import torch
import torch.nn.functional as F

from isoexec_kernels.moe import (MoEWeights, RouterSpec, dispatch, grouped_mm_unsupported, moe_combine,
                                 moe_combine_native, moe_dispatch, moe_dispatch_native, moe_experts,
                                 moe_experts_native, moe_forward_native, moe_forward_reference, moe_route,
                                 moe_route_native)
from isoexec_kernels.moe import native as moe_native

KINDS = {"softmax_topk": dict(top_k=2, norm_topk_prob=True),
         "sigmoid_group_topk": dict(top_k=3, norm_topk_prob=True, n_group=4, topk_group=2, routed_scaling_factor=2.5)}


def _bits(t):
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def _weights(kind, E=8, H=32, inter=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(s, generator=g) * 0.2).to(dtype)  # noqa: E731
    return MoEWeights(router=r(E, H), gate_up=r(E, 2 * inter, H), down=r(E, H, inter),
                      correction_bias=(0.05 * torch.randn(E, generator=g)) if kind != "softmax_topk" else None,
                      shared_gate_up=r(2 * inter, H), shared_down=r(H, inter),
                      shared_gate=r(1, H) if kind == "softmax_topk" else None)


def _shared(x, w, linear, act):
    """The shared expert as the stock layer runs it: gate and up as two products."""
    inter = w.shared_gate_up.shape[0] // 2
    return linear(act(linear(x, w.shared_gate_up[:inter]), linear(x, w.shared_gate_up[inter:])), w.shared_down)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_invariant_regions_in_sequence_equal_the_reference_layer(kind, dtype):
    from isoexec_kernels.activation import silu_and_mul
    from isoexec_kernels.gemm import linear

    w = _weights(kind, dtype=dtype)
    x = torch.randn(29, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    spec = RouterSpec(kind=kind, **KINDS[kind])
    r = moe_route(x, w.router, spec, w.correction_bias, w.shared_gate)
    d = moe_dispatch(r.ids, 8)
    out = moe_combine(moe_experts(x, d, w.gate_up, w.down), d, r, _shared(x, w, linear, silu_and_mul), out_dtype=dtype)
    ref = moe_forward_reference(x, w, kind=kind, **KINDS[kind])
    assert torch.equal(_bits(out), _bits(ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_stock_regions_in_sequence_equal_the_stock_layer(kind, dtype):
    w = _weights(kind, dtype=dtype)
    x = torch.randn(29, 32, generator=torch.Generator().manual_seed(2)).to(dtype)
    spec = RouterSpec(kind=kind, **KINDS[kind])
    r = moe_route_native(x, w.router.to(dtype), spec, w.correction_bias, w.shared_gate)
    d = moe_dispatch_native(r.ids, 8)
    out = moe_combine_native(moe_experts_native(x, d, w.gate_up, w.down), d, r,
                             _shared(x, w, F.linear, lambda g, u: F.silu(g) * u), out_dtype=x.dtype)
    assert torch.equal(_bits(out), _bits(moe_forward_native(x, w, kind=kind, **KINDS[kind])))


def test_stock_dispatch_is_the_stable_expert_sort():
    """transformers' grouped_mm order: the pairs t*k + j ordered by expert, pair order kept inside an
    expert, so token-ascending there whatever slot the stock router put the expert in."""
    ids = torch.tensor([[1, 2], [0, 1]])          # expert 1: token 0 in slot 0, token 1 in slot 1
    ids_topk_order = torch.tensor([[1, 2], [1, 0]])   # the stock router lists experts in top-k order
    assert dispatch(ids, 3).token.tolist() == [1, 0, 1, 0]
    stock = moe_dispatch_native(ids_topk_order, 3)
    assert stock.token.tolist() == [1, 0, 1, 0] and stock.offsets.tolist() == [0, 1, 3, 4]
    assert stock.row_of_pair.tolist() == [1, 3, 2, 0]       # pair t*k + j -> its row
    swapped = moe_dispatch_native(torch.tensor([[2, 1], [1, 0]]), 3)   # token 0 now has expert 1 in slot 1
    assert swapped.token.tolist() == [1, 0, 1, 0] and swapped.offsets.tolist() == [0, 1, 3, 4]
    assert swapped.row_of_pair.tolist() == [3, 1, 2, 0]


# ------------------------------------------------------------------- the stock grouped_mm path
def _loaded_layer(kind, dtype, T=37, hot=5, cold=2, seed=5):
    """(weights, x, spec): expert ``hot`` is chosen by every token and ``cold`` by none (a large
    first feature of x that the router scores up for ``hot``, down for ``cold``; the group router
    also gets a correction bias that selects ``hot``), the rest routed at random."""
    w = _weights(kind, dtype=dtype, seed=seed)
    x = torch.randn(T, 32, generator=torch.Generator().manual_seed(seed + 1))
    x[:, 0] = 4.0
    w.router[:, 0] = 0.0
    w.router[hot, 0], w.router[cold, 0] = 4.0, -4.0
    if w.correction_bias is not None:
        w.correction_bias[hot], w.correction_bias[cold] = 2.0, -2.0
    return w, x.to(dtype), RouterSpec(kind=kind, **KINDS[kind])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_grouped_mm_path_computes_the_eager_loops_layer(kind, dtype):
    """Layer and rows against transformers' eager expert loop, an expert with every token and one
    with none among them. The expert rows are bitwise the loop's (on the CPU torch._grouped_mm is
    one mm per expert over the rows it owns: the loop's products); the layer differs only in the
    combine's rounding (transformers' eager loop rounds each weighted row to the model dtype and
    adds in that dtype, grouped_mm sums a token's k rows with torch.sum and rounds once), so it is
    compared at a tolerance of a few roundings of the model dtype."""
    w, x, spec = _loaded_layer(kind, dtype)
    r = moe_route_native(x, w.router.to(dtype), spec, w.correction_bias, w.shared_gate)
    d = moe_dispatch_native(r.ids, 8)
    counts = d.counts.tolist()
    assert counts[5] == x.shape[0] and counts[2] == 0 and sum(counts) == x.shape[0] * spec.top_k
    assert grouped_mm_unsupported(x, w.gate_up, w.down) is None
    rows = moe_experts_native(x, d, w.gate_up, w.down)
    assert torch.equal(_bits(rows), _bits(moe_native._experts_loop(x, d, w.gate_up, w.down)))
    kw = KINDS[kind]
    grouped = moe_forward_native(x, w, kind=kind, **kw)
    eager = moe_forward_native(x, w, kind=kind, **kw, experts_implementation="eager")
    ref = moe_forward_reference(x.double(), _double(w), kind=kind, **kw)
    err = ((grouped.double() - eager.double()).norm() / eager.double().norm()).item()
    assert err < {torch.float32: 1e-6, torch.bfloat16: 4e-3}[dtype], err
    # both are the layer: the same distance from the float64 evaluation
    for out in (grouped, eager):
        assert ((out.double() - ref).norm() / ref.norm()).item() < {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]


def _double(w: MoEWeights) -> MoEWeights:
    return MoEWeights(**{k: (None if v is None else v.double()) for k, v in vars(w).items()})


def test_grouped_mm_path_is_differentiable_like_the_loop():
    """The native composition's trainer_fwd runs these regions under autograd: the gradients of x and
    of every expert weight match the eager loop's (an expert with no rows gets zero gradient)."""
    w, x, spec = _loaded_layer("sigmoid_group_topk", torch.float32)
    kw = KINDS["sigmoid_group_topk"]
    grads = {}
    for impl in ("grouped_mm", "eager"):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, w.gate_up, w.down)]
        ww = MoEWeights(**{**vars(w), "gate_up": leaves[1], "down": leaves[2]})
        out = moe_forward_native(leaves[0], ww, kind="sigmoid_group_topk", **kw, experts_implementation=impl)
        grads[impl] = torch.autograd.grad(out.square().sum(), leaves)
    for a, b in zip(grads["grouped_mm"], grads["eager"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
    assert grads["grouped_mm"][1][2].abs().max() == 0 and grads["grouped_mm"][1][5].abs().max() > 0


# torch-level methods and aten ops that read device data on the host (a CUDA stream sync, which
# a CUDA graph capture refuses) or that size their output from the data
_HOST_METHODS = {"tolist", "item", "__int__", "__index__", "__bool__", "__float__", "numpy", "cpu"}
_SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::bincount",
             "aten::unique", "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
             "aten::histc", "aten::equal", "aten::is_nonzero"}


class _NoHostSync:
    """Fails on any of the above, on a boolean index (it runs nonzero) and on repeat_interleave
    without output_size; ``seen`` records every aten op for the test's own checks."""

    def __enter__(self):
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        guard = self

        class Fn(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                if name in _HOST_METHODS:
                    raise AssertionError(f"host read: Tensor.{name}")
                return func(*args, **(kwargs or {}))

        class Disp(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                op = func._schema.name
                guard.seen.add(op)
                if op in _SYNC_OPS:
                    raise AssertionError(f"host sync: {op}")
                if op == "aten::repeat_interleave" and (kwargs or {}).get("output_size") is None:
                    raise AssertionError("host sync: repeat_interleave without output_size")
                if op in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
                    idx = args[1] if len(args) > 1 else []
                    if any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx):
                        raise AssertionError(f"host sync: {op} with a boolean index")
                return func(*args, **(kwargs or {}))

        self.seen = set()
        self.modes = [Fn(), Disp()]
        for m in self.modes:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self.modes):
            m.__exit__(*exc)
        return False


def _stock_regions(x, w, spec, E=8):
    r = moe_route_native(x, w.router.to(x.dtype), spec, w.correction_bias, w.shared_gate)
    d = moe_dispatch_native(r.ids, E)
    rows = moe_experts_native(x, d, w.gate_up, w.down)
    return moe_combine_native(rows, d, r, x[:, :rows.shape[-1]] * 0.5, out_dtype=x.dtype)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_stock_regions_make_no_host_sync(kind):
    """Structural check of what a CUDA graph capture needs, on the CPU: router, dispatch, experts
    and combine run with every host read and data-sized op refused (the eager loop trips at once:
    nonzero / torch.where in its dispatch, offsets.tolist() in its experts), and the guarded run
    gives the unguarded bits."""
    w, x, spec = _loaded_layer(kind, torch.bfloat16)
    with _NoHostSync() as guard:
        out = _stock_regions(x, w, spec)
    assert "aten::_grouped_mm" in guard.seen and "aten::sort" in guard.seen
    assert torch.equal(_bits(out), _bits(_stock_regions(x, w, spec)))
    with pytest.raises(AssertionError, match="host (sync|read)"), _NoHostSync():
        moe_forward_native(x, w, kind=kind, **KINDS[kind], experts_implementation="eager")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_stock_regions_run_on_meta_tensors(kind):
    """The same on the meta device, where no tensor has data: every size comes from the shapes."""
    w, x, spec = _loaded_layer(kind, torch.bfloat16)
    meta = MoEWeights(**{k: (None if v is None else v.to("meta")) for k, v in vars(w).items()})
    out = _stock_regions(x.to("meta"), meta, spec)
    assert out.device.type == "meta" and out.shape == x.shape and out.dtype == torch.bfloat16
    with pytest.raises((NotImplementedError, RuntimeError)):   # the eager loop needs the data
        moe_forward_native(x.to("meta"), meta, kind=kind, **KINDS[kind], experts_implementation="eager")


@pytest.mark.parametrize("dtype, H, inter, what", [
    (torch.bfloat16, 36, 16, "hidden size 36 is not a multiple of 8"),
    (torch.bfloat16, 32, 12, "intermediate size 12 is not a multiple of 8"),
    (torch.float32, 32, 6, "intermediate size 6 is not a multiple of 4"),
])
def test_unaligned_operands_fall_back_to_the_loop(dtype, H, inter, what):
    """torch._grouped_mm wants 16-byte row strides; operands without them run the per-expert loop
    (same products, a host sync) instead of failing, and the reason is reported."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(11, H, generator=g).to(dtype)
    gate_up = (0.2 * torch.randn(8, 2 * inter, H, generator=g)).to(dtype)
    down = (0.2 * torch.randn(8, H, inter, generator=g)).to(dtype)
    assert what in grouped_mm_unsupported(x, gate_up, down)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(11)])
    d = moe_dispatch_native(ids, 8)
    ends = d.offsets[1:].to(torch.int32)
    with pytest.raises(RuntimeError, match="16 bytes"):       # what torch._grouped_mm itself says
        h = torch._grouped_mm(x[d.token], gate_up.transpose(-2, -1), offs=ends)
        torch._grouped_mm(F.silu(h[:, :inter]) * h[:, inter:], down.transpose(-2, -1), offs=ends)
    rows = moe_experts_native(x, d, gate_up, down)
    assert torch.equal(_bits(rows), _bits(moe_native._experts_loop(x, d, gate_up, down)))
    ref = moe_native._experts_loop(x.double(), d, gate_up.double(), down.double())
    assert ((rows.double() - ref).norm() / ref.norm()).item() < {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]


def test_grouped_mm_support_checks_the_weight_layout():
    x = torch.randn(4, 32)
    gate_up, down = torch.randn(8, 32, 32), torch.randn(8, 32, 16)
    assert grouped_mm_unsupported(x, gate_up, down) is None
    assert "strides" in grouped_mm_unsupported(x, gate_up.transpose(1, 2).contiguous().transpose(1, 2), down)
    assert "weights are torch.bfloat16" in grouped_mm_unsupported(x, gate_up.bfloat16(), down)
    assert "dtype torch.float64" in grouped_mm_unsupported(x.double(), gate_up.double(), down.double())


def test_router_shared_gate_is_fp32_sigmoid_of_the_invariant_gemm():
    from isoexec_kernels.gemm import linear

    w = _weights("softmax_topk", dtype=torch.bfloat16)
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    r = moe_route(x, w.router, RouterSpec("softmax_topk", 2), None, w.shared_gate)
    assert r.shared_gate.dtype == torch.float32 and r.shared_gate.shape == (7, 1)
    want = torch.sigmoid(linear(x.float(), w.shared_gate.float()).double())
    assert (r.shared_gate.double() - want).abs().max().item() < 1e-6


def test_routing_weights_and_expert_weights_get_gradients():
    from isoexec_kernels.activation import silu_and_mul
    from isoexec_kernels.gemm import linear

    w = _weights("sigmoid_group_topk")
    params = [w.router, w.gate_up, w.down]
    for p in params:
        p.requires_grad_(True)
    x = torch.randn(11, 32, generator=torch.Generator().manual_seed(4))
    spec = RouterSpec("sigmoid_group_topk", **KINDS["sigmoid_group_topk"])
    r = moe_route(x, w.router, spec, w.correction_bias)
    d = moe_dispatch(r.ids, 8)
    out = moe_combine(moe_experts(x, d, w.gate_up, w.down), d, r, _shared(x, w, linear, silu_and_mul))
    grads = torch.autograd.grad(out.square().sum(), params)
    assert all(bool(torch.isfinite(g).all()) and bool((g != 0).any()) for g in grads)



# Every CPU path of the experts region's two implementations under autograd (the Triton grouped
# GEMM's own backward, moe_experts_loop's CUDA path: test_moe_grouped_gemm.py, under the
# interpreter): name -> (the region, the intermediate size that sends it down that path)
_EXPERTS_IMPLS = {
    "moe_experts_loop": (moe_experts, 16),                       # the per-expert loop of the invariant linear
    "torch_moe_experts/grouped_mm": (moe_experts_native, 16),    # aligned operands: torch._grouped_mm
    "torch_moe_experts/loop": (moe_experts_native, 6),           # I = 6 is unaligned in fp32 and bf16: F.linear loop
}


def _experts_grads(name, dtype, T, ids=None, E=8, H=32, seed=11):
    """(rows, [grad x, grad gate_up, grad down], the leaves) of ``name`` on T tokens (``ids`` [T, 2]
    chosen by the caller, none when T = 0) for a random output gradient."""
    fn, inter = _EXPERTS_IMPLS[name]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    gate_up = (0.2 * torch.randn(E, 2 * inter, H, generator=g)).to(dtype).requires_grad_()
    down = (0.2 * torch.randn(E, H, inter, generator=g)).to(dtype).requires_grad_()
    if fn is moe_experts_native:
        assert (grouped_mm_unsupported(x, gate_up, down) is None) == name.endswith("grouped_mm")
    ids = torch.zeros(0, 2, dtype=torch.long) if ids is None else ids
    d = (moe_dispatch_native if fn is moe_experts_native else moe_dispatch)(ids, E)
    rows = fn(x, d, gate_up, down)
    dy = torch.randn(rows.shape, generator=g).to(dtype)
    rows.backward(dy)
    return rows, [x.grad, gate_up.grad, down.grad], (x, gate_up, down)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(_EXPERTS_IMPLS))
def test_experts_of_no_row_give_the_weights_zero_gradients(name, dtype):
    """A batch of no token (the FSDP2 trainer's lockstep empty pass) still runs each implementation
    of the experts region in the graph: its backward gives x and both stacked weights zeros of
    their shapes and dtypes, not None, as a backward of tokens gives every weight a gradient
    (isoexec/dist/fsdp/shard.py: every rank's reduce-scatter must see the same parameters)."""
    rows, grads, leaves = _experts_grads(name, dtype, T=0)
    assert rows.shape == (0, 32) and rows.dtype == dtype and rows.requires_grad
    for what, gr, t in zip(("x", "gate_up", "down"), grads, leaves):
        assert gr is not None, f"{name}: {what} got no gradient"
        assert gr.shape == t.shape and gr.dtype == t.dtype, what
        assert int(torch.count_nonzero(gr)) == 0, what


@pytest.mark.parametrize("name", sorted(_EXPERTS_IMPLS))
def test_an_expert_with_no_rows_gets_a_zero_slice_of_a_whole_gradient(name):
    """Tokens routed to experts 0-3 only: each implementation gives the stacked weights a whole
    gradient, zeros in the slices of experts 4-7 and not in the others'."""
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(4, generator=g)[:2].sort().values for _ in range(9)])
    _, grads, leaves = _experts_grads(name, torch.float32, T=9, ids=ids)
    for gr, t in zip(grads[1:], leaves[1:]):
        assert gr is not None and gr.shape == t.shape
        assert int(torch.count_nonzero(gr[4:])) == 0
        assert all(bool(gr[e].abs().max() > 0) for e in range(4))

# ------------------------------------------------------------------------------ on the GPU
def _gpu_layer(kind, E=16, H=256, inter=128, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return (0.1 * torch.randn(s, generator=g)).to("cuda", torch.bfloat16)

    w = MoEWeights(router=r(E, H), gate_up=r(E, 2 * inter, H), down=r(E, H, inter),
                   correction_bias=(0.05 * torch.randn(E, generator=g)).cuda() if kind != "softmax_topk" else None,
                   shared_gate=r(1, H) if kind == "softmax_topk" else None)
    return w, RouterSpec(kind=kind, **KINDS[kind])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_stock_regions_replay_from_a_cuda_graph(kind):
    """bf16 on the GPU: router, dispatch, experts and combine captured once in a CUDA graph (the
    capture fails on any host sync) and replayed on new inputs copied into its static input give the
    eager bits for those inputs, whatever the experts' loads."""
    w, spec = _gpu_layer(kind)
    assert grouped_mm_unsupported(torch.empty(1, 256, dtype=torch.bfloat16, device="cuda"), w.gate_up, w.down) is None
    static_x = torch.randn(64, 256, device="cuda").to(torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                 # warm-up off the capture stream, as torch advises
        _stock_regions(static_x, w, spec, E=16)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _stock_regions(static_x, w, spec, E=16)
    loads = set()
    for seed in range(4):
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(100 + seed)).to("cuda", torch.bfloat16)
        if seed == 3:
            x[:] = x[0]                           # every token on the same k experts, the rest empty
        static_x.copy_(x)
        graph.replay()
        want = _stock_regions(x, w, spec, E=16)
        r = moe_route_native(x, w.router, spec, w.correction_bias)
        loads.add(tuple(moe_dispatch_native(r.ids, 16).counts.tolist()))
        assert torch.equal(_bits(out.cpu()), _bits(want.cpu())), f"replay {seed}"
    assert len(loads) == 4


@pytest.mark.gpu
def test_stock_experts_refuse_a_capture_that_would_sync():
    """Where torch._grouped_mm would take its host-synchronising fallback (fp32 on CUDA) or the
    operands are unaligned, the experts region says so instead of breaking the capture."""
    w, spec = _gpu_layer("softmax_topk")
    x = torch.randn(8, 256, device="cuda")
    d = moe_dispatch_native(torch.stack([torch.randperm(16)[:2] for _ in range(8)]).cuda(), 16)
    gu, dn = w.gate_up.float(), w.down.float()
    moe_experts_native(x, d, gu, dn)              # eager: torch's fallback runs
    with pytest.raises(RuntimeError, match="cannot run inside a CUDA graph capture: .*bf16 only"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            moe_experts_native(x, d, gu, dn)
    with pytest.raises(RuntimeError, match="cannot run inside a CUDA graph capture: intermediate size 100"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            moe_experts_native(x.bfloat16(), d, w.gate_up[:, :200], w.down[..., :100].contiguous())


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mla_moe", "hybrid_moe"])
def test_native_moe_engine_decodes_in_cuda_graphs(family):
    """The native composition's engine captures its decode steps (the capture that failed at
    torch.where in the eager loop's dispatch) and serves decode steps from them."""
    from isoexec.assembly import installed_model
    from isoexec.engine import Engine, EngineConfig, SamplingParams

    inst = installed_model(family, "native", "sm90", dtype=torch.bfloat16, device="cuda", seed=0)
    m, c, cfg = inst.model, inst.contract, inst.hf_config
    engine = Engine(m, c, EngineConfig(max_num_seqs=8, num_pages=128, cuda_graphs=True), trainer_contract=c)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg["vocab_size"], (int(n),), generator=g).tolist() for n in (5, 9, 17, 3)]
    results = engine.generate(prompts, [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=6)
                                        for i in range(len(prompts))])
    assert engine.runner.graphs is not None and engine.runner.graph_replays > 0
    assert all(len(r.ids) == 6 or r.finish_reason == "stop" for r in results)
