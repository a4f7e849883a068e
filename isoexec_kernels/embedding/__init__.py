"""Token embedding lookup ``table[ids]`` (an exact copy: no Triton twin is needed).

Files: ``api.py`` (the public function and its rounding schedule, in the module docstring),
``reference.py`` (the fixed-order torch twin), ``native.py`` (the stock twin).
"""

from .api import embedding
from .reference import embedding_reference
from .native import embedding_native

__all__ = [
    "embedding",
    "embedding_reference",
    "embedding_native",
]
