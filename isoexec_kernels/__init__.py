"""isoexec's kernel library: batch-invariant kernels and their stock twins (torch, and triton when
installed; nothing of ``isoexec``).

One folder per op: ``rmsnorm``, ``gemm`` (the linear layer), ``rope``, ``attention``,
``activation``, ``embedding``, ``logprob``, ``gated_rmsnorm``, ``sigmoid_gate``, ``gdn_conv``,
``gdn_prep``, ``gdn_core`` and ``moe``. In each: ``api.py`` is the public function (CUDA tensors to
the Triton twin, anything else to the reference twin) and its module docstring is the op's rounding
schedule; ``reference.py`` is the fixed-order torch twin; ``triton_kernels.py`` the Triton twin;
``native.py`` the stock twin (the native composition and the gates' negative control). The op's
``__init__.py`` re-exports its public names.

Shared by the ops: ``_ref.py`` (fixed-order sums and float64 exp/log/sin/cos from basic
operations) and ``_triton_util.py`` (optional triton import, lazy jit, allocator, and ``upload``:
host tensors to the device without a host sync, re-exported here for the engine's batches).
Importing the package itself loads no torch: ``impl.py`` (what an op folder declares, as data) is
read by ``isoexec.registry`` in commands that never run a kernel (``isoexec contract show``), so
``upload`` is looked up on first use rather than imported here.

The import name is ``isoexec_kernels``, not ``kernels``: transformers treats an importable
top-level ``kernels`` module as the Hugging Face kernel hub and changes its behaviour.
"""


def __getattr__(name: str):
    # ``from isoexec_kernels import upload``: _triton_util imports torch, so only when asked for
    if name == "upload":
        from ._triton_util import upload

        return upload
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
