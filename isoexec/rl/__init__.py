"""Synchronous RL loop pieces: prompts, tokenizers, the DAPO reward, group advantages with
dynamic sampling, and per-step metrics. Heavy optional dependencies (datasets, skyrl-gym,
transformers, wandb) are imported only when the function that needs them is called.

Importing the package imports no torch: ``advantages`` and ``metrics`` (torch tensors) are
imported when one of their names below is first read (PEP 562), so the torch-free modules
(``data`` for ``isoexec data synthetic``, ``tables`` for the workflow's table job) load without it.
"""

import importlib

from .data import (DAPO_INSTRUCTION, DataSchemaError, DatasetNotFound, Problem, PromptStream,
                   load_problems, problems_from_rows, synthetic_arithmetic, write_parquet)
from .reward import overlong_penalty, reward, verify
from .tokenizer import CharTokenizer, HFTokenizer, Tokenizer, TokenizerNotFound, chat_prompt, prompt_for

# the names of the modules that import torch, by module
_ON_FIRST_USE = {
    "advantages": ("GroupFiller", "TooManyRounds", "dynamic_sampling", "fill_groups", "group_advantages"),
    "metrics": ("REQUIRED_KEYS", "MetricsFileError", "MetricsWriter", "argmax_flips", "logprob_diff_stats",
                "read_metrics", "summary_line"),
}
_MODULE_OF = {name: module for module, names in _ON_FIRST_USE.items() for name in names}


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "GroupFiller", "TooManyRounds", "dynamic_sampling", "fill_groups", "group_advantages",
    "DAPO_INSTRUCTION", "DataSchemaError", "DatasetNotFound", "Problem", "PromptStream",
    "load_problems", "problems_from_rows", "synthetic_arithmetic", "write_parquet",
    "REQUIRED_KEYS", "MetricsFileError", "MetricsWriter", "argmax_flips", "logprob_diff_stats",
    "read_metrics", "summary_line",
    "overlong_penalty", "reward", "verify",
    "CharTokenizer", "HFTokenizer", "Tokenizer", "TokenizerNotFound", "chat_prompt", "prompt_for",
]
