"""The data-parallel trainer: ``Trainer`` over a ``dp`` device mesh, sharded with FSDP2.

  ``FSDPTrainer``          the trainer (``trainer.py``: sequence assignment, loss, statistics, checkpoints)
  ``shard_model``          one FSDP2 unit per decoder layer plus the root; fp32 shards are the masters
  ``ShardedAdamW``         MasterAdamW's update on the shards, clipped by a fixed-order sharded norm
  ``RankOrderReduceScatter``  the gradient reduce-scatter, ranks added in rank order
  ``ExpertParallelTrainer``  the trainer of an MoE model with its routed experts over an ``ep`` axis
                           (``ep_trainer.py``), its optimizer ``ExpertParallelAdamW`` (``ep_adamw.py``)

This package sits above ``isoexec.train`` (it subclasses ``Trainer``), unlike the rest of
``isoexec/dist/``, which only needs the kernels; tests/test_layers.py gives it a layer of its own.
See docs/scale_out.md for what is bitwise and what is within tolerance.
"""

from .adamw import ShardedAdamW
from .ep_adamw import ExpertParallelAdamW
from .ep_trainer import ExpertParallelTrainer
from .reduce_scatter import RankOrderReduceScatter
from .shard import free_params, shard_model
from .trainer import FSDPTrainer

__all__ = ["ExpertParallelAdamW", "ExpertParallelTrainer", "FSDPTrainer", "RankOrderReduceScatter", "ShardedAdamW",
           "free_params", "shard_model"]
