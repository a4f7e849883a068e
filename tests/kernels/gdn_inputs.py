"""Random inputs of the Gated DeltaNet core shared by its test modules (test_gdn_core.py,
test_gdn_native_wy.py, test_gdn_chunk_backward.py): one draw order, so a seed means the same inputs
in each."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def make_inputs(lens, Hk, H, Dk, Dv, seed, v_dtype=torch.float32, dtype=torch.float32, g_scale=0.5,
                out_grad=False):
    """Random GDN inputs: q, k L2-normalised (q scaled by Dk^-0.5), g <= 0, beta in (0, 1); with
    ``out_grad``, also an output gradient dO [T, H, Dv] in ``dtype``, drawn last."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    k = F.normalize(torch.randn(T, Hk, Dk, generator=gen, dtype=dtype), dim=-1)
    q = F.normalize(torch.randn(T, Hk, Dk, generator=gen, dtype=dtype), dim=-1) * Dk ** -0.5
    v = torch.randn(T, H, Dv, generator=gen, dtype=dtype).to(v_dtype)
    g = -torch.rand(T, H, generator=gen, dtype=dtype) * g_scale
    beta = torch.rand(T, H, generator=gen, dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    if out_grad:
        return q, k, v, g, beta, cu, torch.randn(T, H, Dv, generator=gen, dtype=dtype)
    return q, k, v, g, beta, cu
