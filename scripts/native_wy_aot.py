"""Compile the native WY kernels (isoexec_kernels/gdn_core/native_wy.py and its backward,
native_wy_backward.py) for sm_90 on a machine without a GPU and report, per kernel, shared memory,
registers and spills (ptxas -v) and the tensor-core instruction the dots became. A pre-flight
check before a GPU run, not a measurement: a kernel that spills or needs more than Hopper's 227 KB
of shared memory shows here.

    python3 scripts/native_wy_aot.py [--dot bf16|tf32] [--choice "state_bv=32,state_warps=8" ...]

Each ``--choice`` is a comma list of ``NativeWYChoice`` fields (Qwen3.5 GDN sizes: Dk = Dv = 128,
chunk 64, k fp32, v bf16); without one, the pinned ``NATIVE_WY``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import subprocess
import tempfile

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from isoexec_kernels.gdn_core import native_wy as NW
from isoexec_kernels.gdn_core import native_wy_backward as NB

TARGET = GPUTarget("cuda", 90, 32)


# the integer arguments at the Qwen3.5 sizes (H = 32 value heads of 16 key heads, Dk = Dv = 128,
# q, k [T, 16, 128] fp32, v [T, 32, 128] bf16, o [T, 32, 128], k's bf16 copy [T, 16, 128])
INTS = dict(H=32, REP=2, DK=128, DV=128, s_kt=2048, s_kh=128, s_vt=4096, s_vh=128, s_gt=32, s_bt=32,
            s_qt=2048, s_qh=128, s_ot=4096, s_oh=128, s_ct=2048, s_ch=128, s_dt=4096, s_dh=128)


def _compile(kernel, ptrs: dict, consts: dict, num_warps: int, num_stages: int = 3) -> dict:
    """As a launch compiles: pointers 16-byte aligned and integers that are multiples of 16 carry
    that divisibility (Triton specialises on both), which decides the vector width of loads."""
    fn = kernel.fn
    names = list(inspect.signature(fn).parameters)
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in consts and (n in ptrs or INTS.get(n, 1) % 16 == 0)}
    c = triton.compile(ASTSource(triton.jit(fn), sig, constexprs=consts, attrs=attrs), target=TARGET,
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = c.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    return dict(kernel=fn.__name__, warps=num_warps, stages=num_stages, shared=c.metadata.shared,
                regs=int(regs.group(1)) if regs else None, spill_bytes=int(spill.group(1)) if spill else None,
                dots=sorted(set(re.findall(r"wgmma\.mma_async|mma\.sync\.aligned\.m\d+n\d+k\d+", ptx))))


def check(choice: NW.NativeWYChoice, dot: str = "bf16", Dk: int = 128, Dv: int = 128, C: int = 64,
          backward: bool = True) -> list[dict]:
    """Compile the kernels as ``wy_chunk_triton`` (and ``wy_chunk_backward_triton``) launch them."""
    op = tl.bfloat16 if dot == "bf16" else tl.float32
    prec = "tf32" if dot == "bf16" else dot
    st = "*bf16" if dot == "bf16" else "*fp32"
    DKP, DVP = max(16, triton.next_power_of_2(Dk)), max(16, triton.next_power_of_2(Dv))
    BK = min(choice.bk, DKP, DVP)
    sbv = NW.state_tile(choice, torch.bfloat16 if dot == "bf16" else torch.float32, DVP)   # as launched
    num = dict(OP_DT=op, DOT_DT=op, PREC=prec)
    f32, i32 = "*fp32", "*i32"
    idx = dict(row0_ptr=i32, nrow_ptr=i32, chunk0_ptr=i32, nchunk_ptr=i32, init_idx_ptr=i32, fin_idx_ptr=i32)
    out = [
        _compile(NW._wy_inverse_kernel, dict(k_ptr=f32, g_ptr=f32, b_ptr=f32, gc_ptr=f32, t_ptr=st, **idx),
                 dict(C=C, NB=C // 16, DKP=DKP, BK=BK, INV_PREC=choice.inv_dot, **num), choice.prep_warps),
        _compile(NW._wy_wu_kernel, dict(k_ptr=f32, v_ptr="*bf16", b_ptr=f32, gc_ptr=f32, t_ptr=st, w_ptr=st,
                                        u_ptr=st, kc_ptr=st, **idx),
                 dict(C=C, BK=BK, NKB=-(-Dk // BK), STORE_KC=dot == "bf16", **num), choice.wu_warps),
        _compile(NW._wy_state_kernel, dict(k_ptr=st, gc_ptr=f32, w_ptr=st, u_ptr=st, init_ptr=f32, st_ptr=st,
                                           vn_ptr=st, fin_ptr=f32, **idx),
                 dict(C=C, DKP=DKP, BV=sbv, STORE_ST=True, STORE_VN=True, fin2_ptr=None,
                      fin2_idx_ptr=None, HAS_FIN2=False, **num), choice.state_warps, choice.state_stages),
        _compile(NW._wy_out_kernel, dict(q_ptr=f32, k_ptr=st, gc_ptr=f32, st_ptr=st, vn_ptr=st, o_ptr=f32, **idx),
                 dict(C=C, DKP=DKP, BK=BK, BV=min(choice.out_bv, DVP), **num), choice.out_warps, choice.out_stages),
    ]
    if backward:
        grads = dict(dq_ptr=f32, dk_ptr=f32, dg_ptr=f32, dv_ptr=f32, db_ptr=f32)
        out += [
            _compile(NB._wyb_dvloc_kernel, dict(q_ptr=f32, k_ptr=st, gc_ptr=f32, do_ptr=f32, dvl_ptr=st, **idx),
                     dict(C=C, DKP=DKP, BK=BK, BV=min(choice.out_bv, DVP), **num), choice.out_warps,
                     choice.out_stages),
            _compile(NB._wyb_dhu_kernel, dict(q_ptr=f32, k_ptr=st, gc_ptr=f32, w_ptr=st, do_ptr=f32, dvl_ptr=st,
                                              dsn_ptr=st, dvn_ptr=st, **idx),
                     dict(C=C, DKP=DKP, BV=sbv, **num), choice.dhu_warps, choice.dhu_stages),
            _compile(NB._wyb_dqk_kernel, dict(q_ptr=f32, k_ptr=st, gc_ptr=f32, st_ptr=st, dsn_ptr=st, vn_ptr=st,
                                              dvn_ptr=st, do_ptr=f32, dw_ptr=st, **grads, **idx),
                     dict(C=C, DKP=DKP, DVP=DVP, BK=BK, BV=BK, **num), choice.dqk_warps, choice.bwd_stages),
            _compile(NB._wyb_wy_kernel, dict(k_ptr=st, v_ptr="*bf16", b_ptr=f32, gc_ptr=f32, t_ptr=st, dw_ptr=st,
                                             dvn_ptr=st, dbg_ptr=f32, **grads, **idx),
                     dict(C=C, DKP=DKP, DVP=DVP, BK=BK, BV=BK, KK_MODE=NB.WYB_KK_MODE, **num), choice.wyb_warps, choice.bwd_stages),
        ]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dot", default="bf16", choices=["bf16", "tf32", "tf32x3", "ieee"])
    ap.add_argument("--choice", action="append", default=[])
    args = ap.parse_args(argv)
    choices = [NW.NATIVE_WY] + [
        dataclasses.replace(NW.NATIVE_WY, **{k: (int(v) if v.isdigit() else v) for k, v in
                                             (kv.split("=") for kv in spec.split(","))})
        for spec in args.choice]
    for choice in choices:
        print(choice)
        for r in check(choice, args.dot):
            print(f"  {r['kernel']:20s} warps {r['warps']} stages {r['stages']}  shared {r['shared']:6d} B  "
                  f"regs {r['regs']}  spill {r['spill_bytes']} B  {' '.join(r['dots'])}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
