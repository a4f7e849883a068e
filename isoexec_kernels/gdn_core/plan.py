"""Argument checks and host-side planning shared by the CPR twins (and the stock twin)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .state import GDNState


@dataclass(frozen=True)
class HostPlan:
    """An engine prefill's layout as the host already knows it (the scheduler's numbers), so that
    an impl plans its launches without reading ``cu_seqlens_q``, the slots or the slots' fill counts
    back from the device: each readback is a host sync, which empties the launch queue once per
    layer (on the H200 at 3671620 the native prefill of 5 x 2048 tokens took 1.50 ms of wall time for
    0.95 ms of device time with its readbacks, 1.23 ms with the plan on the host).

    cu_seqlens_q  cumulative new-token counts, B + 1 entries (the device tensor's values)
    slots         each sequence's state slot (the device ``slots``' values)
    processed     tokens each slot's state already holds (the position of the sequence's first new
                  token); the open chunk holds ``processed % chunk`` of them (``fills``)
    """

    cu_seqlens_q: tuple[int, ...]
    slots: tuple[int, ...]
    processed: tuple[int, ...]

    @classmethod
    def of(cls, q_lens, slots, processed) -> "HostPlan":
        """The plan of sequences with ``q_lens`` new tokens each, in ``slots``, after ``processed``."""
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + int(n))
        return cls(tuple(cu), tuple(int(s) for s in slots), tuple(int(p) for p in processed))

    def fills(self, chunk: int) -> list[int]:
        return [p % chunk for p in self.processed]


def engine_layout(host: HostPlan | None, cu_seqlens_q: torch.Tensor, slots: torch.Tensor,
                  state: GDNState | None, chunk: int, T: int, name: str):
    """(starts, lens, slots, fills) of an engine prefill as host lists: from ``host`` when given
    (checked against the shapes it describes), else read back from the device (a host sync each).
    ``fills`` is None without a ``state`` (an impl whose state keeps no open chunk)."""
    if host is None:
        starts, lens = _host_lens(cu_seqlens_q)
        slots_l = [int(s) for s in slots.tolist()]
        fills = None
        if state is not None:
            fills = [int(x) for x in state.fill.index_select(0, slots.to(state.fill.device).long()).tolist()] \
                if slots_l else []
        return starts, lens, slots_l, fills
    B = slots.shape[0]
    if not (len(host.slots) == len(host.processed) == len(host.cu_seqlens_q) - 1 == B) \
            or host.cu_seqlens_q[-1] != T:
        raise ValueError(f"{name}: the host plan describes {len(host.slots)} sequences of "
                         f"{host.cu_seqlens_q[-1]} new tokens, the inputs {B} sequences of {T} tokens")
    cu = host.cu_seqlens_q
    return (list(cu[:-1]), [b - a for a, b in zip(cu[:-1], cu[1:])], list(host.slots),
            host.fills(chunk) if state is not None else None)


def _check(q, k, v, g, beta, name: str) -> tuple[int, int, int, int, int]:
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"{name}: q and k must be [T, Hk, Dk] with the same shape; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}")
    T, Hk, Dk = q.shape
    if v.dim() != 3 or v.shape[0] != T:
        raise ValueError(f"{name}: v must be [T, H, Dv] with T={T}; got {tuple(v.shape)}")
    H, Dv = v.shape[1], v.shape[2]
    if H % Hk:
        raise ValueError(f"{name}: value heads H={H} must be a multiple of key heads Hk={Hk}")
    if g.shape != (T, H) or beta.shape != (T, H):
        raise ValueError(f"{name}: g and beta must be [T, H]=[{T}, {H}]; got g {tuple(g.shape)}, "
                         f"beta {tuple(beta.shape)}")
    if q.dtype not in (torch.float32, torch.float64) or k.dtype != q.dtype:
        raise TypeError(f"{name}: q and k must be float32 (float64 for gradcheck); got {q.dtype}, {k.dtype}")
    if v.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"{name}: v must be bf16/fp16/fp32; got {v.dtype}")
    return T, Hk, Dk, H, Dv


def _check_state(state: GDNState, H: int, Dk: int, Dv: int, chunk: int, name: str) -> None:
    S_, H_, Dk_, Dv_ = state.boundary.shape
    if (H_, Dk_, Dv_) != (H, Dk, Dv) or state.chunk != chunk:
        raise ValueError(f"{name}: state holds H={H_}, Dk={Dk_}, Dv={Dv_}, chunk={state.chunk} but the "
                         f"inputs have H={H}, Dk={Dk}, Dv={Dv}, chunk={chunk}; allocate the state "
                         "with the layer's dimensions")


def _host_lens(cu: torch.Tensor) -> tuple[list[int], list[int]]:
    cu = [int(x) for x in cu.tolist()]
    return cu[:-1], [b - a for a, b in zip(cu[:-1], cu[1:])]


def _float(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _virtual_rows(state, slots_l, fills, starts, lens, chunk):
    """Index lists that lay out, per sequence b, the buffered prefix (fills[b] rows of slot
    slots_l[b]) followed by its new rows: returns (vstarts, vlens, new_dst, new_src, pre_dst,
    pre_slot, pre_pos)."""
    vstarts, vlens = [], []
    new_dst, new_src, pre_dst, pre_slot, pre_pos = [], [], [], [], []
    pos = 0
    for b, (s, n) in enumerate(zip(starts, lens)):
        f = fills[b]
        vstarts.append(pos)
        vlens.append(f + n)
        pre_dst += range(pos, pos + f)
        pre_slot += [slots_l[b]] * f
        pre_pos += range(f)
        new_dst += range(pos + f, pos + f + n)
        new_src += range(s, s + n)
        pos += f + n
    return vstarts, vlens, new_dst, new_src, pre_dst, pre_slot, pre_pos


def chunk_plan(starts: list[int], lens: list[int], chunk: int):
    """Chunks cut from each sequence's first token: per chunk its first row, row count and the
    index of the state entering it; per sequence its first chunk, chunk count and first state
    index (a sequence of n chunks owns n + 1 state slots: the entering states and the final one).
    Returns (row0, nrow, sidx, chunk0, nchunk, starts0, n_states), host lists and the total."""
    row0, nrow, sidx, chunk0, nchunk, starts0 = [], [], [], [], [], []
    n_states = 0
    for s, L in zip(starts, lens):
        nch = -(-L // chunk)
        chunk0.append(len(row0))
        nchunk.append(nch)
        starts0.append(n_states)
        for c in range(nch):
            row0.append(s + c * chunk)
            nrow.append(min(chunk, L - c * chunk))
            sidx.append(n_states + c)
        n_states += nch + 1
    return row0, nrow, sidx, chunk0, nchunk, starts0, n_states
