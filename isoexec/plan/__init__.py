"""The memory plan: before a run is submitted, what each GPU would hold. ``params``: the parameter
count of a model from its config."""

from .params import ParamCount, count_parameters

__all__ = ["ParamCount", "count_parameters"]
