"""The Gated DeltaNet core's engine state: what an engine slot keeps between calls (the boundary state,
the running state and the tokens of the open chunk), and the chunk size C."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


CHUNK = 64
"""Chunk size C: boundary states sit at positions that are multiples of C."""

BOUNDARY = "wy"
"""The pinned form of the boundary update ``chunk_update`` ("rows": the row-by-row inverse with
the decay on k; "wy": the WY kernels' blocked inverse with the decay on Vn, ``cpr_wy.py``); the
reference twin and the Triton twin's ``PINNED`` choice both follow it."""


@dataclass
class GDNState:
    """Recurrent state of one GDN layer for ``S`` engine slots (all fp32 except ``fill``).

    boundary [S, H, Dk, Dv]   state at the last chunk boundary
    running  [S, H, Dk, Dv]   state after the last token (== boundary when fill == 0)
    buf_k    [S, C, H, Dk]    keys of the open chunk, per value head (GQA-expanded)
    buf_v    [S, C, H, Dv]    values of the open chunk (fp32; a chunk-form state may keep them in the
                              values' own dtype, ``value_dtype``: the same values, fewer bytes)
    buf_g    [S, C, H]        log decays of the open chunk
    buf_beta [S, C, H]        betas of the open chunk
    fill     [S] int32        tokens since the last boundary (0 <= fill < C)
    buf_q    [S, C, H, Dk]    queries of the open chunk (CPR version 4's chunk-form decode only;
                              None unless allocated with ``with_q``)
    buf_vn   [S, C, H, Dv]    Vn = U - W S of the open chunk's rows, unrounded (version 4's row
                              decode reads the earlier rows' for its output and, when the chunk
                              completes, for the boundary; None unless allocated with ``with_q``)
    buf_T    [S, C, H, C]     rows of T = (I + A)^-1 of the open chunk, fp32, zero right of the
                              block diagonal (version 4's row decode makes row t from the earlier
                              ones; None unless allocated with ``with_q``)
    boundary_op [S, H, Dk, Dv] ``boundary`` rounded to bf16, the operand dtype of version 4's dots
                              (its row decode reads the state only as an operand: half the bytes
                              of the fp32 one; kept equal to it by prefill and the decode's
                              completion kernel; None unless allocated with ``with_q`` and a
                              ``value_dtype`` other than fp32, whose dots take fp32 operands)
    buf_vn_op [S, C, H, Dv]   ``buf_vn`` rounded to bf16 (the row decode's output reads the rows
                              only as a bf16 operand; allocated with ``boundary_op``)
    """

    boundary: torch.Tensor
    running: torch.Tensor
    buf_k: torch.Tensor
    buf_v: torch.Tensor
    buf_g: torch.Tensor
    buf_beta: torch.Tensor
    fill: torch.Tensor
    buf_q: torch.Tensor | None = None
    buf_vn: torch.Tensor | None = None
    buf_T: torch.Tensor | None = None
    boundary_op: torch.Tensor | None = None
    buf_vn_op: torch.Tensor | None = None

    @classmethod
    def allocate(cls, num_slots: int, H: int, Dk: int, Dv: int, device, chunk: int = CHUNK,
                 with_q: bool = False, value_dtype: torch.dtype = torch.float32) -> "GDNState":
        """Zero state for ``num_slots`` slots; ``with_q``: the chunk form's buffers too (CPR version 4);
        ``value_dtype``: the dtype the values arrive in (the model's). The chunk form keeps the open
        chunk's values in it (bf16 values kept in bf16 are the values kept in fp32, and version 4's
        decode reads half the bytes); the other forms' kernels read fp32 value buffers."""
        f32 = dict(dtype=torch.float32, device=device)
        # bf16 operand copies of the boundary and the open chunk's Vn: version 4 rounds its operands
        # to bf16 only for values that are not fp32 (fp32 values take fp32-accurate dots)
        op_copies = with_q and value_dtype != torch.float32
        return cls(
            boundary=torch.zeros(num_slots, H, Dk, Dv, **f32),
            running=torch.zeros(num_slots, H, Dk, Dv, **f32),
            buf_k=torch.zeros(num_slots, chunk, H, Dk, **f32),
            buf_v=torch.zeros(num_slots, chunk, H, Dv, dtype=value_dtype if with_q else torch.float32, device=device),
            buf_g=torch.zeros(num_slots, chunk, H, **f32),
            buf_beta=torch.zeros(num_slots, chunk, H, **f32),
            fill=torch.zeros(num_slots, dtype=torch.int32, device=device),
            buf_q=torch.zeros(num_slots, chunk, H, Dk, **f32) if with_q else None,
            buf_vn=torch.zeros(num_slots, chunk, H, Dv, **f32) if with_q else None,
            buf_T=torch.zeros(num_slots, chunk, H, chunk, **f32) if with_q else None,
            boundary_op=torch.zeros(num_slots, H, Dk, Dv, dtype=torch.bfloat16, device=device) if op_copies else None,
            buf_vn_op=torch.zeros(num_slots, chunk, H, Dv, dtype=torch.bfloat16, device=device) if op_copies else None,
        )

    @property
    def chunk(self) -> int:
        return self.buf_k.shape[1]

    def buffer_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The open chunks' buffers as token rows (k [S * C, H, Dk], v, g, beta): slot s's chunk is
        rows [s * C, s * C + C), the layout the boundary kernels read in a decode resync."""
        H, Dk, Dv = self.buf_k.shape[2], self.buf_k.shape[3], self.buf_v.shape[3]
        return (self.buf_k.view(-1, H, Dk), self.buf_v.view(-1, H, Dv), self.buf_g.view(-1, H),
                self.buf_beta.view(-1, H))

    def tensors(self) -> list[torch.Tensor]:
        """The allocated tensors (the chunk form's ``buf_q``, ``buf_vn``, ``buf_T``, ``boundary_op`` and
        ``buf_vn_op`` only when they were asked for)."""
        return [t for t in (getattr(self, f.name) for f in fields(self)) if t is not None]

    @property
    def nbytes(self) -> int:
        """Bytes of every allocated tensor (the memory plan counts them)."""
        return sum(t.nbytes for t in self.tensors())

    def reset_(self, slots: torch.Tensor) -> None:
        """Zero the given slots in place (new sequence, preemption, weight update)."""
        slots = slots.to(device=self.fill.device, dtype=torch.long)
        for t in self.tensors():
            t.index_fill_(0, slots, 0)
