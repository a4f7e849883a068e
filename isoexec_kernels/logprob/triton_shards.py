"""The Triton logprob schedule cut at vocabulary chunk boundaries: the pieces a caller that holds only
a slice of each row's logits (a vocabulary-parallel rank on a GPU) computes, and the steps that join
them (CUDA, or CPU under ``TRITON_INTERPRET=1``). ``shards.py`` is the same for the reference
schedule.

The one-row kernel (``triton_kernels._logprob_kernel``, rounding schedule in api.py's docstring)
walks a row's chunks of ``BLOCK_V`` logits left to right with a running max and a running sum:

    m_c     = max(m_{c-1}, max(chunk c)) + 0.0            m_{-1} = -inf
    shift_c = m_c, or 0 while m_c is -inf
    s_c     = s_{c-1} * exp(m_{c-1} - shift_c) + sum_j exp(z_j - shift_c)     s_{-1} = 0

then ``logprob_t = (z_t - m) - log(s)`` with the last m and s. A slice that holds whole chunks can
reproduce it bit for bit in three steps, because:

  * a max is exact, so ``m_c`` is the same whoever computes the chunk maxes it is made of: each
    slice takes its chunks' maxes (:func:`chunk_maxes_triton`) and whoever holds every chunk's max
    runs the recurrence (:func:`prefix_maxes_triton`, the kernel's own ``maximum`` and ``+ 0.0``);
  * a chunk's sum reads only its own logits and ``shift_c``: the slice computes it
    (:func:`chunk_sums_triton`) with the one-row kernel's operations on the same ``BLOCK_V``-wide
    tile, mask and warp count, so ``tl.sum`` reduces it in the same tree;
  * the rescaling chain needs one max and one sum per chunk: whoever holds them all runs it
    (:func:`chain_triton`) with the kernel's expression ``s * exp(m - shift) + sum``, which the
    compiler contracts (or not) the same way in both kernels, then the log and the token's value.

The tree ``tl.sum`` uses follows the register layout Triton picks for the tile, and that follows
what it knows of the address's alignment: it specialises integer arguments that are multiples of
16. The one-row kernel sees the row stride V; a slice sees its own width. Slices start on
``BLOCK_V`` boundaries, so when V is a multiple of 16 every slice's width is too and both kernels
are specialised alike; when it is not, the slice kernel is compiled without specialising its stride
and width (``do_not_specialize``), as the one-row kernel sees them (pass ``vocab_size``). Compiled
for sm90 on a CPU, the two kernels' reductions do get one blocked layout, for V = 151,936 and for
V = 151,937, and the specialised compilation on a whole-chunk slice of the latter would not
(tests/kernels/test_logprob_triton_shards_layout.py). A row stride other than the row's length on
the one-row side is outside this promise; the GPU test (tests/dist/test_vocab_parallel_triton.py)
checks the bits on a device.

Not differentiable by themselves: ``isoexec.dist.vocab_parallel_logprob`` wraps them (its backward
is the one-row kernel's elementwise pass on each slice, given the row's m and log s).
"""

from __future__ import annotations

import torch

from .._triton_util import jit, tl, triton
from .triton_kernels import _NUM_WARPS, BLOCK_V, _token_logprobs_backward_triton

_ROWS_PER_PROGRAM = 128   # the recurrences are elementwise over rows: any row blocking gives the same bits


@jit
def _chunk_max_kernel(z_ptr, out_ptr, Vs, stride_z, chunks, BLOCK: tl.constexpr):
    # program (row, chunk): the chunk's raw max, loaded as the one-row kernel loads it
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    v0 = c * BLOCK
    ok = (v0 + offs) < Vs
    z = tl.load(z_ptr + row * stride_z + v0 + offs, mask=ok, other=float("-inf")).to(tl.float32)
    tl.store(out_ptr + row * chunks + c, tl.max(z, axis=0))


@jit
def _prefix_max_kernel(cmax_ptr, out_ptr, R, chunks, ROWS: tl.constexpr):
    # the one-row kernel's running max over the chunk maxes, for ROWS rows at once (elementwise)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ok = rows < R
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    for c in range(0, chunks):
        x = tl.load(cmax_ptr + rows * chunks + c, mask=ok, other=float("-inf"))
        m = tl.maximum(m, x) + 0.0
        tl.store(out_ptr + rows * chunks + c, m, mask=ok)


def _chunk_sum_body(z_ptr, prefix_ptr, out_ptr, Vs, stride_z, chunks_here, chunks, first_chunk,
                    BLOCK: tl.constexpr):
    # program (row, chunk of this slice): sum_j exp(z_j - shift_c) as the one-row kernel's loop
    # body computes it (the same load, mask, exp and tl.sum over the same BLOCK-wide tile). The
    # load is _chunk_max_kernel's, written out again: lazily jitted kernels cannot call each other
    # (_triton_util.jit)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    v0 = c * BLOCK
    ok = (v0 + offs) < Vs
    z = tl.load(z_ptr + row * stride_z + v0 + offs, mask=ok, other=float("-inf")).to(tl.float32)
    m_new = tl.load(prefix_ptr + row * chunks + first_chunk + c)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    e = tl.where(ok, tl.exp(z - shift), 0.0)
    tl.store(out_ptr + row * chunks_here + c, tl.sum(e, axis=0))


# the same body compiled twice: specialised like a one-row launch whose row length is a multiple of
# 16, and unspecialised in stride and width like one whose row length is not (module docstring)
_chunk_sum_kernel = jit(_chunk_sum_body)
_chunk_sum_kernel_unaligned = jit(_chunk_sum_body, do_not_specialize=["Vs", "stride_z"])


@jit
def _chain_kernel(prefix_ptr, sums_ptr, zt_ptr, lp_ptr, stats_ptr, R, chunks, ROWS: tl.constexpr):
    # the one-row kernel's rescaling chain and epilogue, for ROWS rows at once (elementwise)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ok = rows < R
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    s = tl.full((ROWS,), 0.0, tl.float32)
    for c in range(0, chunks):
        m_new = tl.load(prefix_ptr + rows * chunks + c, mask=ok, other=0.0)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        # (rows past R: s = 1, so that their unused log is 0 and not a log of 0)
        s = s * tl.exp(m - shift) + tl.load(sums_ptr + rows * chunks + c, mask=ok, other=1.0)
        m = m_new
    log_s = tl.log(s)
    tl.store(stats_ptr + 2 * rows, m, mask=ok)
    tl.store(stats_ptr + 2 * rows + 1, log_s, mask=ok)
    zt = tl.load(zt_ptr + rows, mask=ok, other=0.0)
    tl.store(lp_ptr + rows, (zt - m) - log_s, mask=ok)


def num_chunks(width: int) -> int:
    """``BLOCK_V`` chunks in ``width`` logits (the last may be short)."""
    return -(-width // BLOCK_V)


def _slice_rows(z: torch.Tensor) -> torch.Tensor:
    if z.dim() != 2:
        raise ValueError(f"vocabulary slice: logits must be [R, Vs], got shape {tuple(z.shape)}")
    return z.contiguous()


def chunk_maxes_triton(z: torch.Tensor) -> torch.Tensor:
    """Raw fp32 max of each ``BLOCK_V`` chunk of each row of a slice ``z[R, Vs]`` that starts on a
    chunk boundary: ``[R, ceil(Vs / BLOCK_V)]`` (exact; ``-inf`` for a chunk of masked logits)."""
    z = _slice_rows(z)
    R, Vs = z.shape
    C = num_chunks(Vs)
    out = torch.empty((R, C), dtype=torch.float32, device=z.device)
    if R and C:
        _chunk_max_kernel[(R, C)](z, out, Vs, z.stride(0), C, BLOCK=BLOCK_V, num_warps=_NUM_WARPS)
    return out


def prefix_maxes_triton(chunk_maxes: torch.Tensor) -> torch.Tensor:
    """``m_c`` of every chunk from every chunk's raw max ``[R, C]`` in vocabulary order: the one-row
    kernel's ``max(m_{c-1}, max(chunk c)) + 0.0`` from ``-inf`` (fp32 ``[R, C]``)."""
    cmax = chunk_maxes.float().contiguous()
    R, C = cmax.shape
    out = torch.empty_like(cmax)
    if R and C:
        _prefix_max_kernel[(triton.cdiv(R, _ROWS_PER_PROGRAM),)](cmax, out, R, C, ROWS=_ROWS_PER_PROGRAM,
                                                                  num_warps=4)
    return out


def chunk_sums_triton(z: torch.Tensor, prefix_maxes: torch.Tensor, first_chunk: int, vocab_size: int) -> torch.Tensor:
    """``sum_j exp(z_j - shift_c)`` of each chunk of a slice ``z[R, Vs]`` whose first chunk is the
    row's chunk ``first_chunk``, with ``shift_c`` from the whole row's ``prefix_maxes[R, C]``
    (:func:`prefix_maxes_triton`): fp32 ``[R, ceil(Vs / BLOCK_V)]``, the one-row kernel's chunk sums.
    ``vocab_size`` (the whole row's length) picks the compilation that matches the one-row
    kernel's (module docstring)."""
    z = _slice_rows(z)
    R, Vs = z.shape
    Ch = num_chunks(Vs)
    prefix = prefix_maxes.float().contiguous()
    if prefix.shape[0] != R or not 0 <= first_chunk <= prefix.shape[1] - Ch:
        raise ValueError(f"chunk sums: a slice of {R} rows and {Ch} chunk(s) from chunk {first_chunk} "
                         f"does not fit running maxes of shape {tuple(prefix.shape)}")
    out = torch.empty((R, Ch), dtype=torch.float32, device=z.device)
    if R and Ch:
        kernel = _chunk_sum_kernel if vocab_size % 16 == 0 else _chunk_sum_kernel_unaligned
        kernel[(R, Ch)](z, prefix, out, Vs, z.stride(0), Ch, prefix.shape[1], first_chunk,
                        BLOCK=BLOCK_V, num_warps=_NUM_WARPS)
    return out


def chain_triton(prefix_maxes: torch.Tensor, chunk_sums: torch.Tensor, target_logits: torch.Tensor):
    """The one-row kernel's rescaling chain over every chunk of the row in vocabulary order, from
    the running maxes and the chunk sums (both ``[R, C]``), and its epilogue with each row's target
    logit ``target_logits[R]`` (the logit as stored, in fp32): ``(logprobs[R], stats[R, 2])``,
    logprob = (z_t - m) - log s and stats = (m, log s), the backward's row statistics."""
    prefix = prefix_maxes.float().contiguous()
    sums = chunk_sums.float().contiguous()
    zt = target_logits.float().contiguous()
    R, C = prefix.shape
    if tuple(sums.shape) != (R, C) or tuple(zt.shape) != (R,):
        raise ValueError(f"chunk chain: running maxes {tuple(prefix.shape)}, chunk sums {tuple(sums.shape)} "
                         f"and target logits {tuple(zt.shape)} must be [R, C], [R, C] and [R]")
    lp = torch.empty(R, dtype=torch.float32, device=prefix.device)
    stats = torch.empty((R, 2), dtype=torch.float32, device=prefix.device)
    if R:
        _chain_kernel[(triton.cdiv(R, _ROWS_PER_PROGRAM),)](prefix, sums, zt, lp, stats, R, C,
                                                            ROWS=_ROWS_PER_PROGRAM, num_warps=4)
    return lp, stats


def slice_grad_triton(z: torch.Tensor, local_targets: torch.Tensor, stats: torch.Tensor,
                      dy: torch.Tensor) -> torch.Tensor:
    """d logprob / d logits on a slice ``z[R, Vs]``: the one-row backward's elementwise pass,
    ``(onehot - exp((z_j - m) - log s)) * dy`` rounded once to z's dtype, with each row's
    ``stats[R, 2] = (m, log s)`` from :func:`chain_triton` and ``local_targets[R]`` the target's
    column in this slice (any value outside ``[0, Vs)`` where another slice holds it). Each element
    depends only on its own logit and its row's values, so the slices side by side are the whole
    row's gradient, bit for bit."""
    z = _slice_rows(z)
    return _token_logprobs_backward_triton(z, local_targets.reshape(-1).contiguous(), stats.contiguous(), dy)


# ------------------------------------------------------------------------- torch twins (any device)
# The same pieces in torch ops: exact where the step is exact (the maxes), within rounding of the
# kernels elsewhere (torch's exp and sum are not Triton's).

def chunk_maxes_torch(z: torch.Tensor) -> torch.Tensor:
    """:func:`chunk_maxes_triton` in torch (exact: the same values)."""
    R, Vs = z.shape
    C = num_chunks(Vs)
    zp = torch.nn.functional.pad(z.float(), (0, C * BLOCK_V - Vs), value=float("-inf"))
    return zp.reshape(R, C, BLOCK_V).amax(dim=-1)


def prefix_maxes_torch(chunk_maxes: torch.Tensor) -> torch.Tensor:
    """:func:`prefix_maxes_triton` in torch (exact: the same values)."""
    return torch.cummax(chunk_maxes.float(), dim=1).values + 0.0


def chunk_sums_torch(z: torch.Tensor, prefix_maxes: torch.Tensor, first_chunk: int) -> torch.Tensor:
    """:func:`chunk_sums_triton` in torch (within rounding)."""
    R, Vs = z.shape
    C = num_chunks(Vs)
    m = prefix_maxes.float()[:, first_chunk:first_chunk + C]
    shift = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    zp = torch.nn.functional.pad(z.float(), (0, C * BLOCK_V - Vs), value=float("-inf"))
    return torch.exp(zp.reshape(R, C, BLOCK_V) - shift[..., None]).sum(dim=-1)


def chain_torch(prefix_maxes: torch.Tensor, chunk_sums: torch.Tensor, target_logits: torch.Tensor):
    """:func:`chain_triton` in torch (within rounding)."""
    R, C = prefix_maxes.shape
    m = torch.full((R,), float("-inf"), device=prefix_maxes.device)
    s = torch.zeros(R, device=prefix_maxes.device)
    for c in range(C):
        m_new = prefix_maxes[:, c].float()
        shift = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        s = s * torch.exp(m - shift) + chunk_sums[:, c].float()
        m = m_new
    log_s = torch.log(s)
    return (target_logits.float() - m) - log_s, torch.stack([m, log_s], dim=1)
