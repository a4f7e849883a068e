"""Parameters by name, each made when it is read: a sharded trainer's whole parameters for the weight
sync, and an engine rank's cut of them.

A sharded trainer holds 1/dp of every fp32 master. Gathering all of them whole before the engine
copies them (``full_parameters()``, a dict) puts the model's whole fp32 copy on every rank at once:
32 GB for Qwen3-8B, 140 GB for Qwen3.5-35B-A3B, on top of everything the rank already holds. Read
through ``GatheredParameters`` instead, ``Engine.update_weights`` gathers one parameter, copies it
into its own (or cuts this rank's shard of it and copies that), drops it and takes the next, so at
most one whole parameter is alive at a time (the largest: an embedding or a layer's stacked experts).

Reading a value is a collective (``DTensor.full_tensor``, or the ep group's gather of expert slices):
every rank must read the same names in the same order, as every rank's engine does (its model, and
so its parameter order, is the same on every rank). ``shape_of`` needs no communication (a
DTensor's shape is the whole tensor's), so an engine checks every name and shape before the first
collective and all ranks refuse together.

``ShardedView`` is a rank's cut of such a mapping (a tensor-parallel or expert-parallel engine's
``shard_weights``): it cuts each parameter as it is read, and works out the cut's shape on the
``meta`` device, so it stays lazy too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Iterator

import torch


class GatheredParameters(Mapping):
    """``name -> whole fp32 tensor``, gathered by ``gather(name)`` when read and not kept; ``shapes``
    gives every name's whole shape without communication (module docstring)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], gather: Callable[[str], torch.Tensor]):
        self._shapes = {n: tuple(s) for n, s in shapes.items()}
        self._gather = gather

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            raise KeyError(name)
        return self._gather(name)

    def __contains__(self, name) -> bool:   # Mapping's own would read the value (a collective)
        return name in self._shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]


class ShardedView(Mapping):
    """``source`` (any mapping of whole parameters; ``shape_of`` if it has one) with ``cut(name,
    whole)`` applied to the names in ``cut_names`` as each is read; other names pass through."""

    def __init__(self, source: Mapping, cut: Callable[[str, torch.Tensor], torch.Tensor], cut_names):
        self._source, self._cut, self._cut_names = source, cut, frozenset(cut_names)

    def __getitem__(self, name: str) -> torch.Tensor:
        whole = self._source[name]
        return self._cut(name, whole) if name in self._cut_names else whole

    def __contains__(self, name) -> bool:
        return name in self._source

    def __iter__(self) -> Iterator[str]:
        return iter(self._source)

    def __len__(self) -> int:
        return len(self._source)

    def shape_of(self, name: str) -> tuple[int, ...]:
        whole = shape_of(self._source, name)
        if name not in self._cut_names:
            return whole
        return tuple(self._cut(name, torch.empty(whole, device="meta")).shape)


def shape_of(weights: Mapping, name: str) -> tuple[int, ...]:
    """The shape of ``weights[name]``, without reading it where ``weights`` can tell (a lazily
    gathered mapping's ``shape_of``); a plain dict's tensor's own shape."""
    fn = getattr(weights, "shape_of", None)
    return tuple(fn(name)) if fn is not None else tuple(weights[name].shape)


__all__ = ["GatheredParameters", "ShardedView", "shape_of"]
