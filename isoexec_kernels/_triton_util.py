"""Triton plumbing shared by the kernels: optional import, lazy jit, allocator, SM count.

Triton is optional: on a CPU machine without it every kernel module still imports and its
reference twin runs. Kernels are decorated with :func:`jit`, which defers ``triton.jit`` to
the first launch so that ``TRITON_INTERPRET=1`` set by a test (after this module was imported)
is still honoured; one compiled object is kept per mode (interpreted or not).
"""

from __future__ import annotations

import functools
import os

import torch

try:  # pragma: no cover - depends on the machine
    import triton
    import triton.language as tl

    HAS_TRITON = True
    try:  # host-side TMA descriptors (kernel parameters), Triton >= 3.3
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        TensorDescriptor = None
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    TensorDescriptor = None
    HAS_TRITON = False

    class _MissingTritonLanguage:
        """Stand-in for ``triton.language`` so kernel signatures (``X: tl.constexpr``) still
        evaluate; any other use says what is missing."""

        constexpr = None

        def __getattr__(self, name):
            raise RuntimeError(
                f"triton.language.{name} used but triton is not installed; "
                "install the 'gpu' extra (pip install 'isoexec[gpu]') or use the reference twin"
            )

    tl = _MissingTritonLanguage()


__all__ = [
    "HAS_TRITON",
    "TensorDescriptor",
    "triton",
    "tl",
    "jit",
    "interpreting",
    "triton_usable",
    "want_triton",
    "num_sms",
    "ensure_allocator",
    "tma_supported",
    "next_pow2",
]


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_usable(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on ``t``: CUDA tensors with triton installed, or any
    tensor under the interpreter."""
    if not HAS_TRITON:
        return False
    return t.is_cuda or interpreting()


def want_triton(t: torch.Tensor) -> bool:
    """The public dispatch rule of every kernel: a CUDA tensor goes to Triton, anything else to
    the reference twin. (The interpreter is reached only by calling ``*_triton`` directly.)"""
    if t.is_cuda:
        if not HAS_TRITON:
            raise RuntimeError(
                "isoexec_kernels: CUDA tensor given but triton is not installed; the invariant "
                "path needs triton (pip install 'isoexec[gpu]')"
            )
        return True
    return False


class _LazyKernel:
    """A kernel whose ``triton.jit`` happens at first launch, once per interpret mode."""

    def __init__(self, fn, jit_kwargs):
        self.fn = fn
        self.jit_kwargs = jit_kwargs
        self._compiled = {}
        functools.update_wrapper(self, fn)

    def _get(self):
        if not HAS_TRITON:
            raise RuntimeError(
                f"kernel {self.fn.__name__} needs triton, which is not installed; "
                "use the reference twin on CPU"
            )
        mode = interpreting()
        k = self._compiled.get(mode)
        if k is None:
            k = triton.jit(self.fn, **self.jit_kwargs)
            self._compiled[mode] = k
        return k

    def __getitem__(self, grid):
        return self._get()[grid]


def jit(fn=None, **kwargs):
    """``triton.jit`` deferred to the first launch (see module docstring). Kernels decorated
    this way must not call each other (inline helpers instead)."""
    if fn is None:
        return lambda f: _LazyKernel(f, kwargs)
    return _LazyKernel(fn, kwargs)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Number of streaming multiprocessors (persistent grid size); 4 under the interpreter."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _tma_capable(index: int) -> bool:
    return HAS_TRITON and hasattr(tl, "make_tensor_descriptor") and \
        torch.cuda.get_device_capability(index)[0] >= 9


def tma_supported(device: torch.device) -> bool:
    """Whether device-side tensor descriptors (TMA loads) can be used: a CUDA device of
    compute capability 9 or later and a Triton that has ``tl.make_tensor_descriptor``."""
    if device.type != "cuda":
        return False
    return _tma_capable(device.index if device.index is not None else torch.cuda.current_device())


def _scratch_alloc(size: int, alignment: int, stream):
    # Device-side tensor descriptors (TMA) need a small global workspace per launch.
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _scratch_alloc_cpu(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8)


def ensure_allocator(device: torch.device) -> None:
    """Install Triton's workspace allocator. The allocator lives in a ContextVar, so it is set
    before every descriptor launch (cheap) rather than once per process."""
    if HAS_TRITON:
        triton.set_allocator(_scratch_alloc if device.type == "cuda" else _scratch_alloc_cpu)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def upload(host: torch.Tensor, device) -> torch.Tensor:
    """The host tensor ``host`` on ``device`` without a host sync: to a CUDA device it is staged in
    pinned memory and copied without blocking (a blocking copy waits for the stream, i.e. for every
    kernel queued before it; torch's pinned allocator keeps the staging block until the copy has
    read it). Not for use inside a CUDA-graph capture."""
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def upload_ints(xs, dtype: torch.dtype, device) -> torch.Tensor:
    """The ints ``xs`` as a ``dtype`` tensor on ``device`` (``upload``)."""
    return upload(torch.tensor(list(xs), dtype=dtype), device)


def int32_segments(segments, device) -> list[torch.Tensor]:
    """The int lists ``segments`` as int32 tensors on ``device``, made by one asynchronous
    host-to-device copy (``upload``), each view starting on a 16-byte boundary. Triton specialises a
    pointer argument on 16-byte alignment: views packed back to back start at offsets that move with
    the lists' lengths, so a launch compiled a new kernel variant whenever a length crossed a multiple
    of 4 (the GDN state kernel recompiled in the middle of RL runs). Each segment is padded to whole
    16-byte groups."""
    flat, lengths = [], []
    for seg in segments:
        seg = [int(x) for x in seg]
        lengths.append(len(seg))
        flat += seg + [0] * (-len(seg) % 4)
    packed = upload(torch.tensor(flat, dtype=torch.int32), device)
    views, off = [], 0
    for n in lengths:
        views.append(packed[off:off + n])
        off += n + (-n % 4)
    return views
