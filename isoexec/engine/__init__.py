"""Rollout engine: scheduler, block manager (KV pages + recurrent-state slots), model runner
(CUDA graphs on GPU), sampler; returns token ids and the fp32 logprobs the trainer reproduces."""

from .block_manager import BlockManager
from .config import EngineConfig
from .engine import Engine, Progress
from .model_runner import ModelRunner
from .sampler import Sampler
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Result, SamplingParams, Sequence, Status

__all__ = ["BlockManager", "Engine", "EngineConfig", "ModelRunner", "Progress", "Result", "SamplingParams",
           "Sampler", "ScheduledBatch", "Scheduler", "Sequence", "Status"]
