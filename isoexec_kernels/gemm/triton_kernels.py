"""The linear layer: the Triton twin (kernels and their launchers; CUDA, or CPU under
``TRITON_INTERPRET=1``). The rounding schedule is the docstring of ``api.py`` in this folder."""

from __future__ import annotations

import torch

from .._triton_util import (HAS_TRITON, TensorDescriptor, ensure_allocator, interpreting, jit,
                            num_sms, tl, tma_supported, triton)
from .reference import BLOCK_K, _check, block_k_for, k_leaves_for, leaf_bounds, leaf_slice_columns


GROUP_M = 8
"""Tile-raster grouping of the persistent Triton kernel (scheduling only; never changes bits)."""
M_BUCKET_BOUNDS = (16, 64, 256, 1024, 2048)
"""Upper bounds (inclusive) of the M buckets :func:`tile_for_m` switches launches at; a warm-up
that meets both sides of each bound compiles every variant (isoexec.train.precompile)."""


def tile_for_m(M: int, dtype: torch.dtype = torch.bfloat16, N: int = 4096, K: int = 4096,
               leaves: int | None = None) -> dict:
    """Triton launch for a batch of M rows against a weight [N, K] cut into ``leaves`` K leaves
    (default :func:`k_leaves_for`; a row-parallel linear's caller passes the contract's count):
    ``{path, BLOCK_M, BLOCK_N, num_warps, num_stages, warp_specialize, K_TILE}``.

    Only scheduling changes between entries (kernel, tile, warps, stages, and the K tile
    ``K_TILE``: whole BLOCK_K blocks that one ``tl.dot`` chains in K order, :func:`k_tile_for`):
    BLOCK_K (64), the K leaves of the shape (:func:`k_leaves_for`, never a function of M) and the
    K order inside a leaf are the same everywhere, so every entry gives the same bits;
    ``path="split"`` (small M, shapes with more than one leaf) computes the leaves in separate
    programs and sums them in a second pass in the order the fused kernels use (on the H200 every
    candidate of the tile sweep, ``scripts/gemm_tile_sweep.py``, gave identical bf16 outputs for
    the dense-family shapes at M 1..8192; the per-bucket gates
    ``test_linear_cuda_row_alone_equals_row_in_batch_bitwise_every_bucket`` re-check it on each
    GPU). Entries are keyed on the M bucket and the weight shape (N, K) and were picked from that
    sweep's CUDA-graph timings (ratio to cuBLAS in comments, H200, torch 2.11, triton 3.6).
    fp32 inputs use one small tile for all M (the fp32 ``ieee`` dot is an FMA chain)."""
    if dtype == torch.float32:
        # one launch for every M (the fp32 ``ieee`` dot is an FMA chain). The pointer kernel with
        # 16-row tiles: the MoE router's GEMM (N = 64 or 256 experts, K = 2048) took 2.33 ms at
        # M = 1 with the former TMA 64 x 64 launch and 84 us with this one on the H200, and at
        # M = 4096 0.16-0.62 ms instead of 2.5-6.2 ms (scripts/router_gemm_probe.py, 141dbb0)
        return dict(path="pointer", BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=3,
                    warp_specialize=False)

    def cfg(path, bm, bn, warps, stages, ws=False, kt=BLOCK_K):
        return dict(path=path, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages,
                    warp_specialize=ws, K_TILE=kt)

    leaves = k_leaves_for(N, K) if leaves is None else int(leaves)
    if leaves > 1:
        # K cut into leaves (small N): decode sizes (M <= 64) split K over (tile, leaf) programs
        # so about one program per SM reads each weight tile once; from M 65 on one program walks
        # a tile's leaves, with two fp32 tiles live (the sum so far and the leaf), hence no
        # 128 x 256 tiles
        if M <= 16:
            # 8B down (K 12288) at M = 1: 16 x 64 0.93x the one-leaf table, 16 x 128 0.90x
            # (scripts/leaf_walk_small_probe.py at 83fbae4)
            return cfg("split", 16, 32 if N <= 2048 else 64, 4, 4)
        if M <= 64:
            return cfg("split", 64, 32 if N <= 2048 else 64 * (1 + (K > 8192)), 4, 4)
        # M 256 (scripts/leaf_walk_small_probe.py, 4 leaves, against the one-leaf table): the
        # leaf-major walk, for 8B o/down 64 x 128 with K tiles of 128 on 4 stages 0.95 / 0.99x (3
        # stages: 0.81x; split-K 64 x 128: 0.61-0.72x at 17f8e04); for 0.6B o (K 2048) 64 x 64
        # with K tiles of 256 on 3 stages 0.97x (K tiles of 128 on 4 stages: 0.87x), for 0.6B
        # down (K 3072) 64 x 32 with K tiles of 128 on 6 stages 0.92x (64 x 64: 0.91x; K tiles of
        # 256: 0.90x; at 229f9c5). M 1024 (gemm_tile_sweep.py --leaves-small at 17f8e04): the
        # 64 x 128 walk 0.97-1.09x (0.6B), 128 x 128 0.94-0.97x (8B)
        if M <= 256:
            if N > 2048:
                return cfg("tma", 64, 128, 4, 4, kt=128)
            return cfg("tma", 64, 64, 4, 3, kt=256) if K <= 2048 else cfg("tma", 64, 32, 4, 6, kt=128)
        if M <= 1024:
            return cfg("tma", 64, 128, 4, 3, kt=128) if N <= 2048 else cfg("tma", 128, 128, 8, 3, kt=128)
        # the leaf-major walk (LEAF_MAJOR) with K tiles of 128: 4 leaves at M 2048 / 8192 ran at
        # 0.86-0.96x the one-leaf 128 x 128 launch and 0.85-0.90x the one-leaf table (0.6B and 8B
        # o/down; the loop per leaf at 128 x 128 / 4 stages: 0.80-0.89x; gemm_tile_sweep.py
        # --leafwalk at 61fb392)
        return cfg("tma", 128, 128, 8, 3, kt=128)

    # M <= 256: K tiles of 128/256 (``kt``, see k_tile_for: the bits of BLOCK_K 64) halve or quarter
    # the K loop's trips, which is what these latency-bound sizes pay for. Comments: the worst ratio
    # to cuBLAS among the entry's swept rows (M 1 and 16, 64, or 256; scripts/gemm_tile_sweep.py
    # --block-k-all at 8b2397a), then the former entry's
    if M <= 16:  # decode: weight-bandwidth bound, many thin tiles, deep pipelines for long K
        if N > 65536:
            return cfg("pointer", 16, 64, 4, 6)                  # lm_head ~1.0x
        if N > 16384:
            return cfg("pointer", 16, 64, 4, 3, kt=128)          # 8B gate_up 1.02x, was 0.98x
        if K >= 8192:
            return cfg("pointer", 16, 16, 2, 6, kt=256)          # 8B down 1.08x, was 0.81x
        if K >= 4096 and N > 4096:
            return cfg("pointer", 16, 16, 2, 6, kt=128)          # 8B qkv 1.02x, was 0.90x
        if N <= 2048:
            return cfg("pointer", 16, 16, 2, 6, kt=256)          # 0.6B o/down 0.99x, was 0.73x
        if K <= 1024:
            return cfg("pointer", 16, 64, 4, 3, kt=256)          # 0.6B qkv/gate_up 0.90x, was 0.79x
        return cfg("pointer", 16, 32, 4, 4, kt=256)              # 8B o 1.15x, was 0.86x
    if M <= 64:
        if N > 16384:
            return cfg("pointer", 64, 64, 4, 6)                  # lm_head 0.94x, 8B gate_up 0.96x
        if N <= 2048:
            return cfg("pointer", 16, 32, 4, 4, kt=256)          # 0.6B o/down 1.01x, was 0.74x
        if K <= 1024 and N > 4096:
            return cfg("pointer", 64, 64, 4, 4, kt=128)          # 0.6B gate_up 0.96x, was 0.86x
        if K >= 8192:
            return cfg("pointer", 64, 32, 4, 4, kt=256)          # 8B down 1.04x, was 0.88x (dfd4ef4 rows)
        return cfg("pointer", 64, 32, 4, 4, kt=128)              # 0.81x (8B o), was 0.62x
    if M <= 256:
        if N > 16384:
            return cfg("tma", 128, 128, 8, 4)                    # lm_head 0.90x, 8B gate_up 0.92x
        if N <= 2048:
            return cfg("pointer", 64, 32, 4, 4, kt=128)          # 0.6B o/down 0.85x, was 0.66x
        if K <= 1024 and N <= 4096:
            return cfg("pointer", 64, 128, 4, 4, kt=128)         # 0.6B qkv 0.77x, was 0.71x
        if K <= 1024:
            return cfg("pointer", 128, 128, 8, 3)                # 0.6B gate_up 0.71x, was 0.69x (dfd4ef4 rows)
        if N > 4096:
            return cfg("tma", 128, 128, 8, 4)                    # 8B qkv 0.79x
        return cfg("tma", 64, 128, 4, 4, kt=128)                 # 8B o 0.86x, was 0.77x
    if M <= 1024:
        if N <= 2048:
            return cfg("tma", 64, 128, 4, 4)
        return cfg("tma", 128, 128, 8, 4, ws=True)
    if N <= 2048:
        if M <= 2048:
            # 0.6B o 1.04x, down 1.02x with host-side descriptors (0.90x / 0.93x with device-side
            # ones, scripts/gemm_host_desc_probe.py at ddfa0d3); a tie with the 128 x 128 / 4-warp
            # tile (1.05x there; 0.908 vs 0.890x at fc3181a, 0.879 vs 0.893x at 91cc296)
            return cfg("tma", 128, 128, 8, 4, ws=True)
        return cfg("tma", 128, 256, 8, 3, ws=True)       # 0.94-0.98x
    return cfg("tma", 128, 256, 8, 3)                    # 0.6B qkv/gate_up 0.93-1.01x


WS_WALK_MIN_M_NARROW = 1025
"""The least M the warp-specialised walk serves for N <= 2048 (at M 1024 the Triton walk's 64 x 128
tiles were ahead)."""
WS_WALK_MIN_M_WIDE = 1024
"""The least M it serves for N > 2048 (the smallest M it was measured at)."""


def ws_walk_for(M: int, N: int, K: int, leaves: int, dtype: torch.dtype, device: torch.device,
                out_dtype: torch.dtype | None = None) -> dict | None:
    """The warp-specialised Gluon K-leaf walk's launch (``gluon_ws_walk.linear_ws_walk_gluon``:
    the Triton walk's bits, the leaf and the sum in registers, loads by a producer warp) for a
    batch of M rows, or None where the Triton kernels serve it: several leaves, bf16 in and out,
    an sm_90 GPU, rows of x, w and out of 16-byte multiples (TMA), and M past the bucket where
    it was measured ahead of the Triton walk (``scripts/gluon_ws_walk_probe.py`` on the H100:
    1.05-1.12x the Triton walk at M 2048 / 8192 on the 0.6B and 8B row-parallel shapes, 1.11-1.16x
    for 8B at M 1024, but 0.79-0.83x for 0.6B at M 1024). Scheduling only, like
    :func:`tile_for_m`: both walks give the same bits. The ring depth: 6 stages for N <= 2048,
    5 above (the probe's best at M >= 2048)."""
    if leaves <= 1 or dtype != torch.bfloat16 or out_dtype not in (None, dtype) or (K * 2) % 16 or (N * 2) % 16:
        return None
    if M < (WS_WALK_MIN_M_NARROW if N <= 2048 else WS_WALK_MIN_M_WIDE):
        return None
    from .gluon_ws_walk import gluon_ws_walk_supported

    return dict(stages=6 if N <= 2048 else 5) if gluon_ws_walk_supported(device) else None


def gemm_path(N: int, K: int, dtype: torch.dtype, device: torch.device, M: int = 1 << 20,
              leaves: int | None = None) -> str:
    """Which Triton kernel serves (M, N, K): the bucket's ``path`` from :func:`tile_for_m`
    when it is ``"tma"`` and the GPU has TMA and the row strides of x, weight and out are
    16-byte multiples (a function of (N, K) only), else ``"pointer"``. x is copied to an
    aligned contiguous buffer when needed, so its layout never picks the path. The two kernels
    run the same K loop and gave identical bits on the H200 (see :func:`tile_for_m`)."""
    es = dtype.itemsize
    path = tile_for_m(M, dtype, N, K, leaves)["path"]
    if path == "split":   # tile_for_m splits only shapes with more than one K leaf
        return "split"
    if path != "tma":
        return "pointer"
    if tma_supported(device) and (K * es) % 16 == 0 and (N * es) % 16 == 0:
        return "tma"
    return "pointer"


@jit
def _gemm_tma_persistent_kernel(
    x_ptr, w_ptr, out_ptr, bias_ptr, res_ptr, M, N, K, stride_rm,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K_: tl.constexpr, GROUP_M_: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, FLATTEN: tl.constexpr, LEAVES: tl.constexpr,
    PRECISION: tl.constexpr = "ieee", HOST_DESC: tl.constexpr = False, LEAF_MAJOR: tl.constexpr = False,
):
    # Persistent: NUM_PROGRAMS programs walk the output tiles; each tile is computed wholly by
    # one program with the K loop below, so persistence never changes an element's order.
    # (One K loop over all leaves, adding each into the sum at its last block, gave the same bits
    # and ran slower on the H200: results/h200/bench/gemm_leafflat_sweep.json, commit 5e63404.)
    # LEAF_MAJOR (several leaves of equal length, k_steps % LEAVES == 0): the persistent loop walks
    # (tile, leaf) items, one K loop of k_steps / LEAVES blocks each, the sum so far carried from
    # item to item and stored after the tile's last leaf. The leaves are then what tiles are to the
    # one-leaf kernel: the compiler flattens the item loop and its K loop into one pipelined loop,
    # so the loads run on across a leaf's end instead of draining and refilling at every leaf
    # (the loop per leaf below). Same dots, same order, same sums: the same bits.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    n_tiles = tiles_m * tiles_n
    k_steps = tl.cdiv(K, BLOCK_K_)
    if HOST_DESC:
        # descriptors made on the host (kernel parameters): no per-program tensormap write and
        # fence at the start of the kernel
        x_desc = x_ptr
        w_desc = w_ptr
        o_desc = out_ptr
    else:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1],
                                           block_shape=[BLOCK_M, BLOCK_K_])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1],
                                           block_shape=[BLOCK_N, BLOCK_K_])
        o_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[N, 1],
                                           block_shape=[BLOCK_M, BLOCK_N])
    group_span = GROUP_M_ * tiles_n
    if LEAF_MAJOR:
        per_leaf = k_steps // LEAVES
        my_tiles = tl.cdiv(tl.maximum(n_tiles - pid, 0), NUM_PROGRAMS)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for item in tl.range(0, my_tiles * LEAVES, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
            tile = pid + (item // LEAVES) * NUM_PROGRAMS
            leaf = item % LEAVES
            group = tile // group_span
            first_m = group * GROUP_M_
            rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M_)
            tm = first_m + (tile % rows_in_group)
            tn = (tile % group_span) // rows_in_group
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in range(0, per_leaf):
                ks = leaf * per_leaf + kk
                a = x_desc.load([tm * BLOCK_M, ks * BLOCK_K_])
                b = w_desc.load([tn * BLOCK_N, ks * BLOCK_K_])
                part = tl.dot(a, b.T, part, input_precision=PRECISION)
            # leaf 0 as it is (a select, not +0 + part: -0 stays -0), later leaves added in order
            acc = tl.where(leaf == 0, part, acc + part)
            if leaf == LEAVES - 1:
                # the epilogue of the loop per leaf below, written twice (lazily jitted kernels
                # cannot call a shared helper)
                y = acc
                if HAS_BIAS:
                    offs_n = tn * BLOCK_N + tl.arange(0, BLOCK_N)
                    bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
                    y = y + bias[None, :]
                y = y.to(o_desc.dtype)
                if HAS_RES:
                    rm = tm * BLOCK_M + tl.arange(0, BLOCK_M)
                    rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
                    r = tl.load(res_ptr + rm[:, None].to(tl.int64) * stride_rm + rn[None, :],
                                mask=(rm[:, None] < M) & (rn[None, :] < N), other=0.0)
                    y = (y.to(tl.float32) + r.to(tl.float32)).to(o_desc.dtype)
                o_desc.store([tm * BLOCK_M, tn * BLOCK_N], y)
    else:
        for tile in tl.range(pid, n_tiles, NUM_PROGRAMS, flatten=FLATTEN,
                             warp_specialize=WARP_SPECIALIZE):
            group = tile // group_span
            first_m = group * GROUP_M_
            rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M_)
            tm = first_m + (tile % rows_in_group)
            tn = (tile % group_span) // rows_in_group
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for leaf in tl.static_range(LEAVES):
                # each K leaf from +0 in K order; the leaves summed left to right (leaf 0 as it is),
                # as the split-K kernels below compute them
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for ks in range(leaf * k_steps // LEAVES, (leaf + 1) * k_steps // LEAVES):
                    # Out-of-range K columns are zero-filled by the descriptor: same as a zero-padded
                    # last block.
                    a = x_desc.load([tm * BLOCK_M, ks * BLOCK_K_])
                    b = w_desc.load([tn * BLOCK_N, ks * BLOCK_K_])
                    part = tl.dot(a, b.T, part, input_precision=PRECISION)
                if leaf == 0:
                    acc = part
                else:
                    acc = acc + part
            if HAS_BIAS:
                offs_n = tn * BLOCK_N + tl.arange(0, BLOCK_N)
                bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
                acc = acc + bias[None, :]
            y = acc.to(o_desc.dtype)
            if HAS_RES:
                # the residual stream's ``r + y`` in the epilogue: y rounded to the output dtype
                # first, the two added in fp32 and rounded once more, as torch's elementwise add of
                # two tensors of that dtype does -- the bits of the unfused pair
                rm = tm * BLOCK_M + tl.arange(0, BLOCK_M)
                rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
                r = tl.load(res_ptr + rm[:, None].to(tl.int64) * stride_rm + rn[None, :],
                            mask=(rm[:, None] < M) & (rn[None, :] < N), other=0.0)
                y = (y.to(tl.float32) + r.to(tl.float32)).to(o_desc.dtype)
            o_desc.store([tm * BLOCK_M, tn * BLOCK_N], y)


@jit
def _gemm_pointer_kernel(
    x_ptr, w_ptr, out_ptr, bias_ptr, res_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on, stride_rm,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K_: tl.constexpr, GROUP_M_: tl.constexpr, LEAVES: tl.constexpr,
    PRECISION: tl.constexpr = "ieee",
):
    # One program per output tile, same grouping and the same K loop as the TMA kernel.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group_span = GROUP_M_ * tiles_n
    group = pid // group_span
    first_m = group * GROUP_M_
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M_)
    tm = first_m + (pid % rows_in_group)
    tn = (pid % group_span) // rows_in_group
    offs_m = tm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K_)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_steps = tl.cdiv(K, BLOCK_K_)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for leaf in tl.static_range(LEAVES):
        # each K leaf from +0 in K order; the leaves summed left to right (leaf 0 as it is)
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(leaf * k_steps // LEAVES, (leaf + 1) * k_steps // LEAVES):
            k0 = ks * BLOCK_K_
            k_ok = (k0 + offs_k) < K
            a = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :] * stride_xk,
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :] * stride_wk,
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            part = tl.dot(a, b.T, part, input_precision=PRECISION)
        if leaf == 0:
            acc = part
        else:
            acc = acc + part
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    y = acc.to(out_ptr.dtype.element_ty)
    if HAS_RES:  # the residual add of the TMA kernel's epilogue
        r = tl.load(res_ptr + offs_m[:, None].to(tl.int64) * stride_rm + offs_n[None, :],
                    mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, y,
             mask=m_ok[:, None] & n_ok[None, :])


@jit
def _gemm_leaf_partial_kernel(
    x_ptr, w_ptr, part_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, K_TOTAL, LEAF0,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K_: tl.constexpr, GROUP_M_: tl.constexpr,
    LEAVES: tl.constexpr, PRECISION: tl.constexpr = "ieee",
):
    # Split-K: program (tile, j) computes K leaf LEAF0 + j of one output tile, exactly as the
    # fused kernels' leaf loop does, and stores it in fp32 to part[j, M, N]. The leaves are those
    # of a K of K_TOTAL columns, of which x and w hold the K columns from leaf LEAF0's first block
    # on (a row-parallel rank's slice, leaf_partials_triton; the split path passes its whole K and
    # LEAF0 = 0): blocks are counted in the whole K, so a leaf holds the blocks it holds there,
    # and addressed from the slice's start, its width masking the zero padding (a slice ends where
    # K ends or on a leaf bound, so that is the whole K's padding). (The raster and the leaf loop
    # are the pointer kernel's, written out again: lazily jitted kernels cannot call each other,
    # _triton_util.jit.)
    pid = tl.program_id(0)
    j = tl.program_id(1)
    leaf = LEAF0 + j
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group_span = GROUP_M_ * tiles_n
    group = pid // group_span
    first_m = group * GROUP_M_
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M_)
    tm = first_m + (pid % rows_in_group)
    tn = (pid % group_span) // rows_in_group
    offs_m = tm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_steps = tl.cdiv(K_TOTAL, BLOCK_K_)
    first_block = LEAF0 * k_steps // LEAVES
    offs_k = tl.arange(0, BLOCK_K_)
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ks in range(leaf * k_steps // LEAVES, (leaf + 1) * k_steps // LEAVES):
        k0 = (ks - first_block) * BLOCK_K_
        k_ok = (k0 + offs_k) < K
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :] * stride_wk,
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        part = tl.dot(a, b.T, part, input_precision=PRECISION)
    dst = part_ptr + j.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(dst, part, mask=m_ok[:, None] & n_ok[None, :])


@jit
def _gemm_leaf_sum_kernel(part_ptr, out_ptr, bias_ptr, res_ptr, MN, N, stride_om, stride_on, stride_rm,
                          HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, LEAVES: tl.constexpr,
                          BLOCK: tl.constexpr):
    # The leaves of each element summed left to right (leaf 0 as it is), then the bias, then one
    # rounding: the fused kernels' order.
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for leaf in tl.static_range(1, LEAVES):
        acc = acc + tl.load(part_ptr + offs + leaf * MN, mask=ok, other=0.0)
    row = offs // N
    col = offs % N
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + col, mask=ok, other=0.0).to(tl.float32)
    y = acc.to(out_ptr.dtype.element_ty)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_rm + col, mask=ok, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_om + col * stride_on, y, mask=ok)


def _aligned_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Row-major copy when ``t`` is strided or not 16-byte aligned (TMA base requirement)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


_SUM_BLOCK = 1024


def tail_rows_split(M: int, N: int, K: int, dtype: torch.dtype, programs: int, leaves: int = 1) -> int | None:
    """Scheduling only: the number of leading rows to run with the bucket's tiles when its last
    wave of output tiles would leave most SMs idle, the remaining rows then taking the 2048-row
    bucket's smaller tiles (same K loop, same bits: every tile of the tile table gives identical
    bits, see :func:`tile_for_m`); None for one launch. Only large M with few output columns
    (N <= 2048) qualifies: Qwen3-0.6B o_proj / down_proj at M = 10240 are 320 tiles of 128 x 256
    on 132 SMs, 2.4 waves whose third is 42% busy (0.87-0.89x cuBLAS); cutting at 8448 rows
    (two full waves) leaves 1792 rows as 112 tiles of 128 x 128, half a wave's time. A function
    of (M, N, K, the device's SM count), never of the data. Several K leaves: None (their walk
    has one tile at every M)."""
    if M <= M_BUCKET_BOUNDS[-1] or N > 2048 or leaves > 1:
        return None
    cfg = tile_for_m(M, dtype, N, K)
    if cfg["path"] != "tma":
        return None
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    tiles_n = -(-N // bn)
    tiles = -(-M // bm) * tiles_n
    full_waves, rest = divmod(tiles, programs)
    if full_waves == 0 or rest == 0 or rest * 2 > programs:
        return None   # one wave or less, an exact fit, or a last wave at least half busy
    head = (full_waves * programs // tiles_n) * bm
    return head if 0 < head < M else None


_SM90_SHARED_MEMORY = 232448   # bytes a block may opt in to on sm90 (H100 / H200)


def tma_takes_residual(cfg: dict, kt: int = BLOCK_K) -> bool:
    """Whether a TMA launch of tile ``cfg`` with K tiles of ``kt`` adds the residual in its
    epilogue: with warp specialisation always; without it where the stages, the output tile and
    the residual's conversion scratch (the output tile's size, at most 32 KiB) fit in shared
    memory together. Calibrated on the H200: 128 x 256 at 3 stages (K tile 64) asked 245,784 bytes
    and 128 x 128 at 3 stages with K tiles of 128 asked 262,168, more than its 232,448; every
    tile of the H200 probe gave 0 differing elements against the separate add
    (scripts/gemm_residual_probe.py, results/h200/bench/gemm_residual_probe_ae6aab3.log). Those
    tiles add after their launch (same bits). The tile key ``tma_residual`` forces either way
    (the probe)."""
    if "tma_residual" in cfg:
        return bool(cfg["tma_residual"])
    if cfg.get("warp_specialize", False):
        return True
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    need = cfg["num_stages"] * (bm + bn) * kt * 2 + bm * bn * 2 + min(bm * bn * 2, 32768)
    return need <= _SM90_SHARED_MEMORY


def k_tile_for(cfg: dict, bk: int, K: int, leaves: int, dtype: torch.dtype) -> int:
    """K columns one ``tl.dot`` of the launch takes: the tile's ``K_TILE`` (default BLOCK_K), used
    only where it is sure to keep the schedule of BLOCK_K blocks: 16-bit inputs (the tensor cores
    chain a dot's k16 steps into the fp32 accumulator in K order, so one dot over 128 columns is the
    two dots over 64 in turn; fp32's ``ieee`` dot keeps BLOCK_K), a K that K_TILE divides (no
    wider zero padding) and, with several K leaves, leaf bounds that fall on K_TILE boundaries
    (the kernels count a leaf's bounds in K tiles, :func:`leaf_bounds` in BLOCK_K blocks: both
    must name the same columns). On the H200
    every K_TILE of 128 and 256 gave the bits of 64 at every tile and M tried
    (``scripts/gemm_tile_sweep.py --block-k``), and the per-bucket GPU gates re-check it. Under the
    interpreter ``tl.dot`` is the host BLAS's matmul, whose bits depend on the tile's K width: the
    interpreter makes no invariance claim (see the tests)."""
    kt = int(cfg.get("K_TILE", bk))
    if kt == bk or dtype == torch.float32 or kt % bk or K % kt:
        return bk
    per, tiles = kt // bk, K // kt
    # the kernels' leaf j starts at K tile j * tiles // leaves: the same column as leaf_bounds' block?
    if any(j * tiles // leaves * per != b0 for j, (b0, _) in enumerate(leaf_bounds(K, leaves))):
        return bk
    return kt


def _launch_tma(x2, w, out, bias_arg, has_bias, cfg, bk, leaves, prec, programs, res=None):
    M, K = x2.shape
    N = w.shape[0]
    bm, bn, kt = cfg["BLOCK_M"], cfg["BLOCK_N"], k_tile_for(cfg, bk, K, leaves, x2.dtype)
    if res is not None and not tma_takes_residual(cfg, kt):
        _launch_tma(x2, w, out, bias_arg, has_bias, cfg, bk, leaves, prec, programs)
        out.add_(res)   # the separate add: the epilogue's bits (out rounded, then torch's add)
        return
    ws = bool(cfg.get("warp_specialize", False)) and x2.is_cuda and not interpreting()
    flatten = cfg.get("flatten", not ws)
    res_arg, res_stride = _residual_args(res, out)
    # descriptors made on the host by default: on the H200 the device-side ones cost 3-35% at the
    # 8-45 us kernels (0.6B o_proj at M = 2048: 0.90x cuBLAS with them, 1.04x without; every row
    # gave the same bits either way, scripts/gemm_host_desc_probe.py at ddfa0d3). The tile key
    # ``host_desc`` forces either (the probe); the interpreter always builds them in the kernel
    host_desc = bool(cfg.get("host_desc", True)) and TensorDescriptor is not None and x2.is_cuda \
        and not interpreting()
    if host_desc:
        x_arg = TensorDescriptor(x2, [M, K], [K, 1], [bm, kt])
        w_arg = TensorDescriptor(w, [N, K], [K, 1], [bn, kt])
        o_arg = TensorDescriptor(out, [M, N], [N, 1], [bm, bn])
    else:
        ensure_allocator(x2.device)   # device-side descriptors need Triton's workspace
        x_arg, w_arg, o_arg = x2, w, out
    _gemm_tma_persistent_kernel[(programs,)](
        x_arg, w_arg, o_arg, bias_arg, res_arg, M, N, K, res_stride,
        HAS_BIAS=has_bias, HAS_RES=res is not None, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K_=kt, GROUP_M_=GROUP_M,
        NUM_PROGRAMS=programs, WARP_SPECIALIZE=ws, FLATTEN=flatten, LEAVES=leaves, PRECISION=prec,
        HOST_DESC=host_desc, LEAF_MAJOR=leaf_major(cfg, K, kt, leaves),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def leaf_major(cfg: dict, K: int, kt: int, leaves: int) -> bool:
    """Whether the TMA kernel walks (tile, leaf) items (``LEAF_MAJOR``): several leaves of equal
    length in K tiles, unless the tile key ``leaf_major`` says otherwise (the sweep). Scheduling
    only: the same bits either way."""
    return leaves > 1 and -(-K // kt) % leaves == 0 and bool(cfg.get("leaf_major", True))


def _residual_rows(residual, M: int, N: int):
    """``residual`` as [M, N] rows with unit column stride (a copy only when it has none)."""
    if residual is None:
        return None
    r = residual.reshape(M, N)
    return r if N <= 1 or r.stride(1) == 1 else r.contiguous()


def _residual_args(res, out) -> tuple[torch.Tensor, int]:
    """The kernels' (residual pointer, row stride): ``out`` and 0 when there is none (HAS_RES off)."""
    return (out, 0) if res is None else (res, res.stride(0))


def _triton_2d(x2, w, bias, impl=None, tile=None, leaves=None, precision=None, out_dtype=None,
               residual=None):
    M, K = x2.shape
    N = w.shape[0]
    res = _residual_rows(residual, M, N)
    # the accumulator is fp32 whatever the output: out_dtype=fp32 for 16-bit inputs skips the
    # final rounding (same kernels, same K loop: only the last cast differs)
    out = torch.empty((M, N), dtype=out_dtype or x2.dtype, device=x2.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        out.zero_()
        if bias is not None:
            out.copy_((out.float() + bias.float()).to(out.dtype))
        if res is not None:
            out.add_(res)
        return out
    leaves = k_leaves_for(N, K) if leaves is None else int(leaves)
    cfg = dict(tile_for_m(M, x2.dtype, N, K, leaves), **(tile or {}))
    path = impl or gemm_path(N, K, x2.dtype, x2.device, M, leaves)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    bk = block_k_for(N, K)
    # "ieee": an fp32 FMA chain for fp32 inputs (tensor cores, exact products, for 16-bit ones);
    # other precisions are a tuning probe only (scripts/router_gemm_probe.py), never the default
    prec = precision or "ieee"
    leaf_bounds(K, leaves)  # checks 1 <= leaves <= number of K blocks
    has_bias = bias is not None
    bias_arg = bias if has_bias else out
    if path == "split" and leaves == 1:
        path = "pointer"  # one leaf: nothing to split
    if path == "tma" and out.element_size() > x2.element_size():
        # a wider output (fp32 logits from 16-bit inputs) would double the TMA epilogue's
        # shared-memory tile; the pointer kernel stores from registers (same K loop, same bits)
        path = "pointer"
    ws = (ws_walk_for(M, N, K, leaves, x2.dtype, x2.device, out_dtype)
          if impl is None and tile is None and precision is None else None)
    if impl == "gluon_ws" or ws is not None:
        # several K leaves at large M on sm_90: the warp-specialised walk (same bits)
        from .gluon_ws_walk import linear_ws_walk_gluon

        return linear_ws_walk_gluon(x2, w, leaves, bias=bias, residual=res,
                                    **(ws or {"stages": 6, **(tile or {})}))
    if path == "tma":
        x2 = _aligned_contiguous(x2)
        w = _aligned_contiguous(w)
        # always one program per SM (those past the last tile find no work): the grid size is a
        # compile-time constant, and min(SMs, tiles) would compile a new kernel for every tile
        # count below the SM count, i.e. for almost every small M
        # ``programs_per_sm`` > 1 lets small tiles share an SM (scheduling only: each tile is still
        # one program's K loop)
        programs = num_sms(x2.device) * int(cfg.get("programs_per_sm", 1))
        head = tail_rows_split(M, N, K, x2.dtype, programs, leaves) if tile is None else None
        if head is None:
            _launch_tma(x2, w, out, bias_arg, has_bias, cfg, bk, leaves, prec, programs, res)
        else:
            # rows are independent and every tile runs the same K loop, so the two launches give
            # each row the bits one launch would (rows past `head` just use smaller tiles)
            tail_cfg = tile_for_m(M_BUCKET_BOUNDS[-1], x2.dtype, N, K)
            _launch_tma(x2[:head], w, out[:head], bias_arg, has_bias, cfg, bk, leaves, prec, programs,
                        None if res is None else res[:head])
            _launch_tma(x2[head:], w, out[head:], bias_arg, has_bias, tail_cfg, bk, leaves, prec, programs,
                        None if res is None else res[head:])
    elif path == "pointer":
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
        res_arg, res_stride = _residual_args(res, out)
        _gemm_pointer_kernel[grid](
            x2, w, out, bias_arg, res_arg, M, N, K,
            x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1), res_stride,
            HAS_BIAS=has_bias, HAS_RES=res is not None, BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_K_=k_tile_for(cfg, bk, K, leaves, x2.dtype),
            GROUP_M_=GROUP_M, LEAVES=leaves, PRECISION=prec, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    elif path == "split":
        # small M: one program per (tile, leaf) writes the leaf in fp32, a second pass sums the
        # leaves in order, adds the bias and rounds -- the fused kernels' arithmetic, in two steps
        part = torch.empty((leaves, M, N), dtype=torch.float32, device=x2.device)
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), leaves)
        _gemm_leaf_partial_kernel[grid](
            x2, w, part, M, N, K, x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), K, 0,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K_=bk, GROUP_M_=GROUP_M, LEAVES=leaves, PRECISION=prec,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
        res_arg, res_stride = _residual_args(res, out)
        _gemm_leaf_sum_kernel[(triton.cdiv(M * N, _SUM_BLOCK),)](
            part, out, bias_arg, res_arg, M * N, N, out.stride(0), out.stride(1), res_stride,
            HAS_BIAS=has_bias, HAS_RES=res is not None, LEAVES=leaves, BLOCK=_SUM_BLOCK, num_warps=4,
        )
    else:
        raise ValueError(f"linear_triton: unknown impl {impl!r} (expected 'tma', 'pointer', 'split' or 'gluon_ws')")
    return out


def leaf_sum_triton(partials: torch.Tensor, bias: torch.Tensor | None = None,
                    out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`leaf_sum_reference` in one launch: the split-K path's second pass (the leaves left
    to right, the bias, one rounding) on partials made elsewhere, e.g. gathered from the ranks of
    a row-parallel linear. Rounding schedule: the reference's."""
    L, M, N = partials.shape
    part = partials.contiguous()
    out = torch.empty((M, N), dtype=out_dtype, device=part.device)
    if M * N == 0:
        return out
    has_bias = bias is not None
    res_arg, res_stride = _residual_args(None, out)
    _gemm_leaf_sum_kernel[(triton.cdiv(M * N, _SUM_BLOCK),)](
        part, out, bias if has_bias else out, res_arg, M * N, N, out.stride(0), out.stride(1), res_stride,
        HAS_BIAS=has_bias, HAS_RES=False, LEAVES=L, BLOCK=_SUM_BLOCK, num_warps=4,
    )
    return out


def leaf_partials_triton(x: torch.Tensor, weight: torch.Tensor, *, in_features: int, leaves: int,
                         first_leaf: int, count: int, tile: dict | None = None) -> torch.Tensor:
    """Triton twin of :func:`leaf_partials_reference` (api.py's ``leaf_partials``) in one launch:
    the split-K kernel's programs (tile, leaf) for leaves ``first_leaf ..`` of the whole K's
    schedule, reading the K slice that holds them. CUDA, or CPU under ``TRITON_INTERPRET=1``
    (fp32/fp16 there: the interpreter's bf16 dot is broken). ``tile`` overrides entries of the
    launch (tests and tuning, as :func:`linear_triton`'s)."""
    cols = leaf_slice_columns(x, weight, in_features, leaves, first_leaf, count)
    M, N = x.shape[0], weight.shape[0]
    part = torch.empty((count, M, N), dtype=torch.float32, device=x.device)
    if M == 0 or N == 0:
        return part
    # each program does what a program of a one-leaf fp32-output linear of the leaf did (the call
    # each leaf had before this launch): that call's tile (a wider output sends tile_for_m's
    # "tma" entries to the pointer kernel, whose K loop this kernel has) and, where every leaf
    # starts on one, its K tile (k_tile_for: the same bits as BLOCK_K blocks)
    cfg = dict(tile_for_m(M, x.dtype, N, max(b - a for a, b in cols), leaves=1), **(tile or {}))
    bk = k_tile_for(cfg, block_k_for(N, in_features), in_features, leaves, x.dtype)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]), count)
    _gemm_leaf_partial_kernel[grid](
        x, weight, part, M, N, x.shape[1], x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        in_features, first_leaf,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K_=bk, GROUP_M_=GROUP_M, LEAVES=leaves,
        PRECISION="ieee", num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return part


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  impl: str | None = None, tile: dict | None = None, leaves: int | None = None,
                  precision: str | None = None, out_dtype: torch.dtype | None = None,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of :func:`linear_reference` (api.py's docstring). ``impl`` forces
    ``"tma"`` or ``"pointer"`` (or ``"gluon_ws"``, the warp-specialised Gluon walk on sm_90,
    where ``tile`` may name its ``stages``); by default :func:`gemm_path` decides from (N, K)
    alone, and :func:`ws_walk_for` sends several K leaves at large M on sm_90 to the Gluon walk.
    ``tile`` overrides entries of :func:`tile_for_m` (tuning and gates only: BLOCK_M, BLOCK_N,
    num_warps, num_stages, warp_specialize, flatten, programs_per_sm, tma_residual (the TMA
    kernel's own residual epilogue, a probe), K_TILE (:func:`k_tile_for`); BLOCK_K cannot be
    overridden; ``path``
    in ``tile`` is ignored, use ``impl``).
    Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (fp32/fp16 only:
    the interpreter's bf16 dot is broken). ``out_dtype`` (default x's dtype): the dtype of the one
    final rounding; fp32 keeps the fp32 accumulator as it is."""
    _check(x, weight, bias, out_dtype, residual)
    K = x.shape[-1]
    out = _triton_2d(x.reshape(-1, K), weight, bias, impl, tile, leaves, precision, out_dtype, residual)
    return out.reshape(*x.shape[:-1], weight.shape[0])
