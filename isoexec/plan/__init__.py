"""The memory plan: before a run is submitted, what each GPU would hold. ``params``: the parameter
count of a model from its config; ``states``: the bytes per parameter of each state the trainer and
the engine keep; ``engine_pools``: the engine's KV and recurrent-state pools; ``activations``: an
activation estimate, stated as an assumption."""

from .params import ParamCount, count_parameters
from .states import BytesPerParam, bytes_per_param

__all__ = ["BytesPerParam", "ParamCount", "bytes_per_param", "count_parameters"]
