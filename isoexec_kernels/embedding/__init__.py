"""Token embedding lookup ``table[ids]`` (an exact copy: no Triton twin is needed)."""

from ..impl import Impl
from .api import embedding
from .reference import embedding_reference
from .native import embedding_native

IMPLS = (
    Impl("embed_gather", "1", "embed", embedding, doc="row gather: no arithmetic, invariant by construction"),
    Impl("torch_embedding", "torch", "embed", embedding_native, native=True),
)

__all__ = [name for name in dir() if not name.startswith("_")]
