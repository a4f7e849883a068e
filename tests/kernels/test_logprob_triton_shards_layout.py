"""The vocabulary-parallel pieces of the Triton logprob schedule reduce each chunk in the one-row
kernel's tree on an H100/H200: ``tl.sum`` follows the register layout Triton gives the chunk, and
that follows what the compiler knows of the row stride's alignment (triton_shards.py's docstring).
Compiled here for sm90 (no GPU needed: the TTGIR of ``triton.compile``), the chunk-sum kernel's
reduction operands carry the same blocked layout as the one-row kernel's, for a vocabulary that is
a multiple of 16 and one that is not, in bf16 and fp32; and the specialised compilation, used where
it does not belong, would not (so the check can tell the two apart)."""

from __future__ import annotations

import importlib.util
import inspect
import re

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _reduce_layouts(jitted, ptrs: dict, consts: dict, divisible: set) -> list[str]:
    """The blocked layout of every ``tt.reduce`` operand of ``jitted`` compiled for sm90, with the
    integer arguments in ``divisible`` (and every pointer) specialised as multiples of 16, as a
    launch specialises them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = jitted.fn
    names = list(inspect.signature(fn).parameters)
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in consts and (n in ptrs or n in divisible)}
    try:
        c = triton.compile(ASTSource(triton.jit(fn), sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
    except Exception as exc:   # pragma: no cover - a triton without its NVIDIA backend
        pytest.skip(f"cannot compile for sm90 here ({type(exc).__name__}: {exc})")
    ttgir = c.asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<\{[^}]*\}>)", ttgir, re.M))
    found = re.findall(r"\"tt\.reduce\"\(%[\w#]+\).*?\(tensor<4096xf32, (#\w+)>\)", ttgir, re.S)
    return [layouts[a] for a in found]


def _one_row(dtype: str, divisible: bool) -> list[str]:
    from isoexec_kernels.logprob import triton_kernels as tk

    return _reduce_layouts(tk._logprob_kernel, dict(z_ptr=dtype, tgt_ptr="*i64", lp_ptr="*fp32", ls_ptr="*fp32",
                                                    stats_ptr="*fp32"),
                           dict(WANT_TOKEN=True, WANT_FULL=False, WANT_STATS=True, BLOCK=4096),
                           {"V", "stride_z", "stride_ls"} if divisible else {"stride_ls"})


def _chunk_sum(kernel, dtype: str, width: int) -> list[str]:
    """The chunk-sum kernel as a launch on a contiguous slice ``width`` logits wide compiles it: the
    width (and row stride) specialised when a multiple of 16, unless the kernel does not specialise
    them (its ``do_not_specialize``)."""
    plain = set(kernel.jit_kwargs.get("do_not_specialize", ()))
    divisible = ({"Vs", "stride_z"} if width % 16 == 0 else set()) - plain
    return _reduce_layouts(kernel, dict(z_ptr=dtype, prefix_ptr="*fp32", out_ptr="*fp32"), dict(BLOCK=4096),
                           divisible | {"chunks"})


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_chunk_sums_reduce_in_the_one_row_kernels_layout_on_sm90(dtype):
    from isoexec_kernels.logprob import triton_shards as ts

    for V in (151936, 151937):   # Qwen3's vocabulary, and one that is not a multiple of 16
        one = _one_row(dtype, V % 16 == 0)
        # the one-row kernel reduces each chunk twice (max, sum), both in one layout
        assert len(one) >= 2 and len(set(one)) == 1, one
        # the kernel chunk_sums_triton picks for this vocabulary, on a slice of whole chunks (a rank
        # other than the last: 8192 wide) and on the last rank's slice (the rest of the row)
        kernel = ts._chunk_sum_kernel if V % 16 == 0 else ts._chunk_sum_kernel_unaligned
        for width in (8192, V - 36 * 4096):
            mine = _chunk_sum(kernel, dtype, width)
            assert mine and set(mine) == set(one), (V, width, mine, one)
    # negative control: the specialised compilation on a whole-chunk slice of a vocabulary that is not
    # a multiple of 16 vectorises where the one-row kernel cannot
    assert set(_chunk_sum(ts._chunk_sum_kernel, dtype, 8192)) != set(_one_row(dtype, False))
