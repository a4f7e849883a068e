"""Synchronous RL loop pieces: prompts, tokenizers, the DAPO reward, group advantages with
dynamic sampling, and per-step metrics. Heavy optional dependencies (datasets, skyrl-gym,
transformers, wandb) are imported only when the function that needs them is called."""

from .advantages import GroupFiller, TooManyRounds, dynamic_sampling, fill_groups, group_advantages
from .data import (DAPO_INSTRUCTION, DataSchemaError, DatasetNotFound, Problem, PromptStream,
                   load_problems, problems_from_rows, synthetic_arithmetic, write_parquet)
from .metrics import (REQUIRED_KEYS, MetricsFileError, MetricsWriter, argmax_flips,
                      logprob_diff_stats, read_metrics, summary_line)
from .reward import overlong_penalty, reward, verify
from .tokenizer import CharTokenizer, HFTokenizer, Tokenizer, TokenizerNotFound, chat_prompt, prompt_for

__all__ = [
    "GroupFiller", "TooManyRounds", "dynamic_sampling", "fill_groups", "group_advantages",
    "DAPO_INSTRUCTION", "DataSchemaError", "DatasetNotFound", "Problem", "PromptStream",
    "load_problems", "problems_from_rows", "synthetic_arithmetic", "write_parquet",
    "REQUIRED_KEYS", "MetricsFileError", "MetricsWriter", "argmax_flips", "logprob_diff_stats",
    "read_metrics", "summary_line",
    "overlong_penalty", "reward", "verify",
    "CharTokenizer", "HFTokenizer", "Tokenizer", "TokenizerNotFound", "chat_prompt", "prompt_for",
]
