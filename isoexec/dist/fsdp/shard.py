"""Shard a unified model with FSDP2 over the ``dp`` axis: one unit per decoder layer, plus the root.

``shard_model(model, mesh)`` applies ``torch.distributed.fsdp.fully_shard`` to every module of
``model.layers`` and then to the model itself (the root unit holds the embedding, the final norm
and an untied lm_head). Each parameter becomes a DTensor sharded along dim 0 over ``dp``; the
optimizer steps the shards (``adamw.py``).

Precision: the sharded parameters are fp32 and are the optimizer's master weights. A model built
in bf16 is converted to fp32 one unit at a time, each just before ``fully_shard`` cuts it (so a
rank holds at most one unit whole in fp32 beside the rest of the model still in bf16 and the
shards made so far; converting the whole model first held it all in fp32 at once: 4 bytes per
parameter on every rank, 139 GB for Qwen3.5-35B-A3B), and computes in bf16 through FSDP2's ``MixedPrecisionPolicy``
(``param_dtype`` bf16): each shard is rounded to bf16 before the all-gather, which is
``master.to(bf16)``, the value ``MasterAdamW.sync_params`` writes into a single process's bf16
parameters. Gradients are reduced in fp32 (``reduce_dtype``) and stay fp32 on the shards, as the
single process accumulates its bf16 gradients into fp32 masters.

Gradient reduction: a plain sum (divide factor 1: the loss of each rank is already its share of
the global mini-batch loss, ``trainer.py``), by ``RankOrderReduceScatter`` (rank order, fixed
bits). FSDP2 reduce-scatters, per unit, the parameters that have a gradient after the backward, so
every rank's backward must give the same parameters a gradient, or the ranks' reduce-scatters
differ in size. The models give every parameter that requires one a gradient in every backward,
including a backward of no token (the lockstep's empty passes, ``trainer.py``): a parameter no
token reached gets zeros. The routed experts are stacked parameters (``experts_gate_up``
[E, 2I, H], ``experts_down`` [E, H, I] per layer), so an expert a rank routed no row to is a zero
slice of a gradient the layer's other experts fill; and when no expert has a row (a pass of no
token), every implementation of the ``experts`` region still returns a result in the graph whose
backward gives both stacked weights zeros (``isoexec_kernels.moe.reference.no_rows``; the Triton
grouped GEMM's backward gives zeros for no row itself). Where FSDP2 has
``set_reduce_scatter_unused_params`` (torch 2.13) it is switched on as well (FSDP2 then
reduce-scatters zeros for a parameter without a gradient), so the same parameters take part either
way and the sums are the same bits; torch 2.11's FSDP2 lacks it, and shards every family,
the MoE families with their experts included, on the models' gradients alone. Tested on the CPU
with the switch removed (tests/train/test_empty_pass_gradients.py, tests/dist/test_fsdp_moe.py);
not yet on a GPU under torch 2.11 (docs/scale_out.md says what that leaves).

Parameters left out (``ignored``): the expert-parallel trainer keeps each rank's routed-expert
slices out of FSDP2 (``fully_shard``'s ``ignored_params``): they differ from rank to rank (FSDP2
would take them for shards of one parameter, and cannot cut 6 experts over 4 ranks as 1, 2, 1, 2)
and their gradients are reduced over other ranks than the replicated parameters'
(``ep_adamw.py``). They stay plain parameters in the model's own dtype, untouched by the fp32
conversion and the mixed-precision cast (the optimizer keeps their fp32 masters), and no FSDP2
collective reads them. Both trainers (``ep_trainer.py`` and ``trainer.py``) leave the frozen
parameters out too (GLM's router correction bias: fp32 in a bf16 model, which the mixed-precision
cast would round to bf16; replicated, with no gradient to reduce).

When parameters are gathered: one layer at a time. FSDP2's hooks fire around a module's forward
method; the unified models run each decoder layer through ``model.run_layer(L, layer_fn, x)`` (the
layer loop's one call per layer, which names the layer's module; it runs ``layer_fn(x)``,
checkpointed when activation checkpointing is on), never calling the layer as a module. So each
layer gets a small forward method, ``fsdp_run(layer_fn, x) = layer_fn(x)``, registered with
``register_fsdp_forward_method``, and the sharded model's ``run_layer`` calls the model's own
``run_layer`` through it. The layer units reshard after forward:

- forward: a layer is gathered in its pre-forward hook and freed in its post-forward hook, with
  or without a graph (scoring frees each layer as it goes). On a GPU the next layer's all-gather
  may be issued while this one computes (FSDP2's streams; the CPU runs ahead), so up to two layers
  are gathered; on the CPU one;
- backward: the post-forward hook put a hook on the layer's output, which gathers the layer again
  when its gradient arrives (FSDP2's pre-backward; it also gathers the layer before it, FSDP2's
  default backward prefetch: again at most two); with activation checkpointing the recompute runs
  then, inside the gathered unit (the checkpoint is inside ``fsdp_run``, torchtitan's order); once
  the gradient of the layer's input is complete, the post-backward reduce-scatters the layer's
  gradients and frees the layer.

With ``reshard_after_forward=False`` (``TrainConfig.reshard_after_forward``) the layer units
stay gathered from their forward until their backward: the pre-backward gather finds the layer
gathered and does nothing, the post-backward frees it as above; a forward without a graph
(scoring) keeps every layer it passed until ``free_params``, so the scoring pass's later
micro-batches gather nothing. One gather per layer and micro-batch instead of two, and one per
scoring pass instead of one per micro-batch, for the whole model's compute-dtype copy held at the
forward's end (``isoexec.plan`` counts it). The values gathered are the same shards' same casts,
so nothing computed changes (tests/dist/test_fsdp_per_layer.py).

The root unit (embedding, final norm, lm_head) is gathered at the entry of ``hidden_states`` (the
root's registered forward method) and is not freed after the forward (``reshard_after_forward``
False: lm_head runs after ``hidden_states`` returns, in ``token_logprobs``); the backward's end frees
it, or ``free_params`` after a forward without a graph.

Every backward reduce-scatters (the trainer never turns gradient sync off): FSDP2 adds each
micro-batch's reduced fp32 shard into ``param.grad`` (in micro-batch order), so between
micro-batches a rank holds its shards and their gradients and nothing gathered. Every rank must
therefore run the same number of forward and backward passes: each one is a series of collectives
(``trainer.py``, lockstep).

Between optimizer steps everything is sharded: the trainer frees the parameters after every
forward-only pass, and the backward frees them, so the optimizer only ever writes shards that no
gathered copy shadows.
"""

from __future__ import annotations

import types
import warnings
from typing import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from .reduce_scatter import RankOrderReduceScatter

# FSDP2 warns when a forward method returns a view (hidden_states ends in a reshape): an in-place
# op on that view would skip its pre-backward hook. Nothing here writes into it (scoring indexes
# rows out of it, a copy), so the warning is silenced for this one call.
_VIEW_WARNING = r"FSDP2-wrapped module .* returned a view tensor"


def _layer_forward(layer: nn.Module, layer_fn, x: torch.Tensor) -> torch.Tensor:
    """A layer unit's forward method (``fsdp_run``): FSDP2's pre- and post-forward hooks run
    around this call, and its post-backward hook attaches to ``x``, which FSDP2 passes in."""
    return layer_fn(x)


def units(model: nn.Module) -> list[FSDPModule]:
    """The FSDP2 units of a sharded model: its layers in order, then the root."""
    return [*model.layers, model]


def compute_dtype(model: nn.Module, ignored=frozenset()) -> torch.dtype:
    dtypes = {p.dtype for p in model.parameters() if p not in ignored}
    if len(dtypes) != 1:
        raise ValueError(f"shard_model: the model's parameters have several dtypes {sorted(map(str, dtypes))}; "
                         "the trainer shards a model built in one dtype (fp32 or bf16)")
    return dtypes.pop()


def _to_fp32(params: Iterable[nn.Parameter], ignored) -> None:
    """Convert ``params`` to fp32 in place, but for ``ignored`` ones and those fp32 already (one
    parameter at a time: its compute-dtype data is dropped as its fp32 copy replaces it)."""
    with torch.no_grad():
        for p in params:
            if p not in ignored and p.dtype != torch.float32:
                p.data = p.data.to(torch.float32)


def shard_model(model: nn.Module, mesh: DeviceMesh, ignored: Iterable[nn.Parameter] = (),
                reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``model`` in place over ``mesh`` (a 1-D ``dp`` mesh); returns it. ``ignored``:
    parameters FSDP2 leaves alone; ``reshard_after_forward``: whether a layer is freed after its
    forward or kept until its backward (module docstring). See the module docstring for the units,
    the precision and when parameters are gathered."""
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"shard_model: reshard_after_forward must be a bool, got {reshard_after_forward!r}")
    ignored = set(ignored)
    if isinstance(model, FSDPModule):
        raise ValueError("shard_model: the model is already sharded")
    if not isinstance(getattr(model, "layers", None), nn.ModuleList) or not hasattr(model, "hidden_states") \
            or not hasattr(model, "run_layer"):
        raise ValueError(f"shard_model: {type(model).__name__} is not a unified model (needs .layers, "
                         ".hidden_states and .run_layer)")
    dtype = compute_dtype(model, ignored)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"shard_model: parameters are {dtype}; the trainer computes in fp32 or bf16")
    mp = MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32,
                              cast_forward_inputs=False)
    kw = dict(mesh=mesh, mp_policy=mp, ignored_params=ignored or None)
    # the shards are the fp32 masters; compute stays in `dtype` (the ignored parameters too). Each
    # unit is converted just before its fully_shard, which copies it into fp32 shards and drops
    # the whole: one unit's whole fp32 copy at a time beside the rest still in `dtype` (converting
    # the model first held all of it whole in fp32 at once). The conversion is exact either way.
    for layer in model.layers:
        _to_fp32(layer.parameters(), ignored)
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kw)
    # the root: every parameter outside the layers (those are fp32 shards by now); it stays
    # gathered after its forward: lm_head runs after hidden_states returns
    _to_fp32(model.parameters(), ignored)
    fully_shard(model, reshard_after_forward=False, **kw)
    for unit in units(model):
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_custom_reduce_scatter(RankOrderReduceScatter())
    if hasattr(model, "set_reduce_scatter_unused_params"):
        # torch 2.13: zeros for a parameter without a gradient. Without it (torch 2.11) the models'
        # own zero gradients keep the ranks' parameter lists equal (module docstring)
        model.set_reduce_scatter_unused_params(True)

    for layer in model.layers:
        layer.fsdp_run = types.MethodType(_layer_forward, layer)
        register_fsdp_forward_method(layer, "fsdp_run")
    run_layer = model.run_layer      # the model's own: checkpointed inside the unit's call

    def run_layer_in_its_unit(L, layer_fn, x):
        return L.fsdp_run(lambda x: run_layer(L, layer_fn, x), x)

    model.run_layer = run_layer_in_its_unit
    register_fsdp_forward_method(model, "hidden_states")
    fsdp_run = model.hidden_states

    def hidden_states(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_VIEW_WARNING)
            return fsdp_run(*args, **kwargs)

    model.hidden_states = hidden_states
    return model


def free_params(model: nn.Module) -> None:
    """Free every gathered parameter (no communication); the shards stay."""
    for unit in units(model):
        unit.reshard()
