"""The memory plan (``isoexec plan --config``): before a run is submitted, what each GPU would hold.

For every family of a workflow config, at its parallel sizes: the parameter count from the model
config (``params``), the bytes per parameter of each state the trainer and the engine keep
(``states``; under the expert-parallel trainer, the routed-expert slice a GPU holds: ``expert_slices``),
the engine's KV and recurrent-state pools from its settings (``engine_pools``), an
activation estimate stated as an assumption (``activations``), and the total against one GPU's
memory with a verdict (``rows``). ``workflow_config`` reads the config as the workflow does; ``memory``
puts it together; ``render`` prints it as text or markdown. docs/scale_out.md, "Memory plan".
"""

from .expert_slices import ExpertSlices, expert_slices
from .memory import MemoryPlan, memory_plan
from .params import ParamCount, count_parameters
from .render import render_markdown, render_text
from .states import BytesPerParam, bytes_per_param

__all__ = ["BytesPerParam", "ExpertSlices", "MemoryPlan", "ParamCount", "bytes_per_param", "count_parameters",
           "expert_slices", "memory_plan", "render_markdown", "render_text"]
