"""Token embedding lookup ``table[ids]`` (an exact copy: no Triton twin is needed).

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``native.py`` (the stock twin).

``IMPLS`` (at the end) declares the implementations isoexec's registry collects: the invariant
kernel and its stock twin (``isoexec_kernels/impl.py``).
"""

from ..impl import Impl
from .api import embedding
from .reference import embedding_reference
from .native import embedding_native

__all__ = [
    "IMPLS",
    "embedding",
    "embedding_reference",
    "embedding_native",
]

IMPLS = (
    Impl("embed_gather", "1", "embed", embedding, doc="row gather: no arithmetic, invariant by construction"),
    Impl("torch_embedding", "torch", "embed", embedding_native, native=True),
)
