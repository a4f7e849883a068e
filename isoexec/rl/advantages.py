"""Group-normalised advantages (GRPO/DAPO) and DAPO's dynamic sampling.

Each prompt is sampled ``group_size`` times; a response's advantage is its reward relative to
its group::

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps),   eps = 1e-6

``std`` is the SAMPLE standard deviation (Bessel's correction, divisor G - 1). That is what
verl's GRPO estimator computes (``torch.std`` with its default ``unbiased=True``), and the DAPO
reference runs are verl runs; the population std (divisor G) would scale every advantage by
sqrt((G-1)/G). As in verl, a group of one response gets mean 0 and std 1 (A = r / (1 + eps)).

The statistics are computed with correctly rounded Python float64 arithmetic (``math.fsum``,
``math.sqrt``), not a vectorised reduction whose summation order can depend on the CPU's vector
width, so the same rewards give the same advantage bits on every host; the result is cast once
to the requested dtype. A group whose rewards are all equal gets advantage exactly 0.

Dynamic sampling (DAPO): a group whose responses all got the same reward (all right or all
wrong) has zero advantage everywhere and contributes no gradient, so it is dropped and the
batch is refilled from the next prompts until it holds the target number of groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Generic, Sequence, TypeVar

import torch

T = TypeVar("T")
P = TypeVar("P")

EPS = 1e-6


def _values(rewards) -> list[float]:
    if isinstance(rewards, torch.Tensor):
        return [float(x) for x in rewards.detach().reshape(-1).tolist()]
    return [float(x) for x in rewards]


def _groups(values: list[float], group_size: int, who: str) -> list[list[float]]:
    if group_size < 1:
        raise ValueError(f"{who}: group_size must be >= 1, got {group_size}")
    if len(values) % group_size:
        raise ValueError(f"{who}: {len(values)} rewards do not split into groups of {group_size} "
                         f"(responses of one prompt must be contiguous, group after group)")
    return [values[i:i + group_size] for i in range(0, len(values), group_size)]


def group_mean_std(group: Sequence[float]) -> tuple[float, float]:
    """(mean, sample std) of one group; (0, 1) for a single value, as verl does."""
    n = len(group)
    if n == 0:
        raise ValueError("group_mean_std: empty group")
    if n == 1:
        return 0.0, 1.0
    mean = math.fsum(group) / n
    var = math.fsum((x - mean) * (x - mean) for x in group) / (n - 1)
    return mean, math.sqrt(var)


def group_advantages(rewards, group_size: int, eps: float = EPS,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Advantages ``[N]`` for ``N = groups * group_size`` rewards laid out group after group."""
    values = _values(rewards)
    out: list[float] = []
    for g in _groups(values, group_size, "group_advantages"):
        mean, std = group_mean_std(g)
        out.extend((x - mean) / (std + eps) for x in g)
    return torch.tensor(out, dtype=torch.float64).to(dtype)


def dynamic_sampling(values, group_size: int) -> list[bool]:
    """Keep-mask, one bool per group: False for a group whose values are all identical.

    Pass what DAPO filters on - per-response accuracy (its recipes use ``metric=acc``), not the
    length-penalised reward, which can differ between responses that are all right. Identical
    means exactly equal (verl tests ``np.std(...) > 0``, which agrees for the +-1 and 0/1 values
    used here). A group of one response is kept, as in verl: it has nothing to compare with.
    """
    keep = []
    for g in _groups(_values(values), group_size, "dynamic_sampling"):
        keep.append(len(g) == 1 or any(x != g[0] for x in g))
    return keep


class TooManyRounds(RuntimeError):
    """Dynamic sampling gave up: the allowed generation rounds did not yield enough groups."""


@dataclass
class GroupFiller(Generic[T]):
    """Accumulates the kept groups of successive generation rounds until ``target`` are held.

    Groups are kept in arrival order; :meth:`take` returns exactly the first ``target`` and drops
    any surplus, as DAPO's trainer truncates the batch. ``max_rounds`` (DAPO's
    ``max_num_gen_batches``; None = unlimited) stops a run whose prompts have become all-solved
    or all-failed instead of generating forever.
    """

    target: int
    max_rounds: int | None = None
    kept: list[T] = field(default_factory=list)
    rounds: int = 0
    generated: int = 0            # groups generated so far
    dropped: int = 0              # groups removed by the filter

    def __post_init__(self):
        if self.target < 1:
            raise ValueError(f"GroupFiller: target must be >= 1, got {self.target}")

    @property
    def deficit(self) -> int:
        return max(0, self.target - len(self.kept))

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.target

    def add(self, groups: Sequence[T], keep: Sequence[bool]) -> int:
        """Record one generation round; returns how many of its groups were kept."""
        if len(groups) != len(keep):
            raise ValueError(f"GroupFiller.add: {len(groups)} groups but {len(keep)} keep flags")
        self.rounds += 1
        n_kept = 0
        for g, k in zip(groups, keep):
            self.generated += 1
            if k:
                self.kept.append(g)
                n_kept += 1
            else:
                self.dropped += 1
        if not self.full and self.max_rounds is not None and self.rounds >= self.max_rounds:
            raise TooManyRounds(f"dynamic sampling: {self.rounds} generation round(s) gave "
                                f"{len(self.kept)} of {self.target} groups with varied rewards "
                                f"({self.dropped} of {self.generated} dropped); the prompts may be "
                                f"all solved or all failed - raise max_rounds or check the data")
        return n_kept

    def take(self) -> list[T]:
        if not self.full:
            raise RuntimeError(f"GroupFiller.take: only {len(self.kept)} of {self.target} groups")
        return self.kept[:self.target]


def fill_groups(next_prompts: Callable[[int], Sequence[P]],
                rollout: Callable[[Sequence[P]], tuple[Sequence[T], Sequence[float]]],
                target: int, group_size: int, *, round_size: int | None = None,
                max_rounds: int | None = None) -> GroupFiller[T]:
    """Generate until ``target`` groups with varied values are held (DAPO dynamic sampling).

    ``next_prompts(k)`` gives the next k prompts (e.g. ``PromptStream.next_batch``);
    ``rollout(prompts)`` returns one group object per prompt and the flat filter values (e.g.
    accuracies) of all ``len(prompts) * group_size`` responses, group after group. Each round
    asks for ``round_size`` prompts (DAPO's fixed ``gen_batch_size``) or, when None, for exactly
    the number of groups still missing. Returns the filler; ``.take()`` is the batch.
    """
    filler: GroupFiller[T] = GroupFiller(target, max_rounds)
    while not filler.full:
        prompts = next_prompts(round_size if round_size is not None else filler.deficit)
        groups, values = rollout(prompts)
        if len(groups) != len(prompts):
            raise ValueError(f"fill_groups: rollout returned {len(groups)} groups for {len(prompts)} prompts")
        filler.add(groups, dynamic_sampling(values, group_size))
    return filler
