"""Group-normalised advantages (verl GRPO definition) and DAPO dynamic sampling with refill."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from isoexec.rl.advantages import (EPS, GroupFiller, TooManyRounds, dynamic_sampling, fill_groups,
                                   group_advantages, group_mean_std)
from isoexec.rl.data import Problem, PromptStream


def test_known_values_use_sample_std():
    # mean -0.5; squared deviations 2.25 + 3 * 0.25 = 3; sample var 3 / 3 = 1 -> std 1
    a = group_advantages([1.0, -1.0, -1.0, -1.0], 4, dtype=torch.float64)
    assert a.tolist() == [1.5 / (1 + EPS), -0.5 / (1 + EPS), -0.5 / (1 + EPS), -0.5 / (1 + EPS)]
    # two responses: sample std sqrt(2) (population std would be 1 and give +-1)
    b = group_advantages([1.0, -1.0], 2, dtype=torch.float64)
    assert b.tolist() == [1 / (math.sqrt(2) + EPS), -1 / (math.sqrt(2) + EPS)]


def test_zero_variance_groups_get_exactly_zero():
    a = group_advantages([1, 1, 1, -1, -1, -1, 0.5, 0.5, 0.5], 3)
    assert a.dtype == torch.float32 and torch.equal(a, torch.zeros(9))


def test_single_response_groups_follow_verl():
    assert group_mean_std([0.7]) == (0.0, 1.0)
    a = group_advantages([1.0, -1.0], 1, dtype=torch.float64)
    assert a.tolist() == [1 / (1 + EPS), -1 / (1 + EPS)]


def _verl_reference(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """verl's GRPO formula written with torch (torch.std default: unbiased)."""
    g = rewards.reshape(-1, group_size)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + EPS)).reshape(-1)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(2, 8), st.integers(0, 2**31 - 1))
def test_matches_the_verl_formula(groups, size, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(groups * size, generator=g, dtype=torch.float64)
    ours = group_advantages(rewards, size, dtype=torch.float64)
    torch.testing.assert_close(ours, _verl_reference(rewards, size), rtol=1e-12, atol=1e-12)


def test_deterministic_and_independent_of_neighbours():
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 2, (32,), generator=g).double() * 2 - 1 + torch.rand(32, generator=g) * 0.1
    a = group_advantages(r, 8)
    assert torch.equal(a, group_advantages(r.tolist(), 8))            # list or tensor
    # a group's advantages are the same bits wherever it sits in the batch
    swapped = torch.cat([r[8:16], r[:8], r[16:]])
    b = group_advantages(swapped, 8)
    assert torch.equal(b[:8], a[8:16]) and torch.equal(b[8:16], a[:8])
    assert torch.equal(group_advantages(r[8:16], 8), a[8:16])


def test_bad_layout_is_refused():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages([1.0] * 6, 4)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages([1.0], 0)


def test_dynamic_sampling_drops_all_equal_groups():
    acc = [1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0]
    assert dynamic_sampling(acc, 4) == [False, True, False]
    assert dynamic_sampling(torch.tensor([1.0, -1.0, 1.0, 1.0]), 2) == [True, False]
    assert dynamic_sampling([1.0, 1.0, 0.0], 1) == [True, True, True]   # singletons kept (verl)


def test_filler_keeps_order_and_truncates_surplus():
    f = GroupFiller(target=3)
    assert f.add(["a", "b", "c"], [True, False, True]) == 2
    assert not f.full and f.deficit == 1
    f.add(["d", "e"], [True, True])
    assert f.full and f.take() == ["a", "c", "d"]
    assert (f.rounds, f.generated, f.dropped) == (2, 5, 1)
    with pytest.raises(ValueError):
        f.add(["x"], [True, False])


def _stream(n=40, seed=0):
    return PromptStream([Problem(f"p{i}", f"t{i}", "0") for i in range(n)], batch_size=4, seed=seed)


def _fake_rollout(group_size):
    """Prompts whose number is divisible by 3 get all-correct groups (no signal)."""
    def rollout(prompts):
        values, groups = [], []
        for p in prompts:
            k = int(p.id[1:])
            values += [1.0] * group_size if k % 3 == 0 else [1.0] + [0.0] * (group_size - 1)
            groups.append(p.id)
        return groups, values
    return rollout


@pytest.mark.parametrize("round_size", [None, 6])
def test_fill_groups_refills_from_the_next_prompts(round_size):
    stream = _stream()
    filler = fill_groups(stream.next_batch, _fake_rollout(4), target=8, group_size=4,
                         round_size=round_size)
    batch = filler.take()
    assert len(batch) == 8 and all(int(i[1:]) % 3 for i in batch)
    # the kept groups are the first 8 varied prompts in stream order
    order = [p.id for p in _stream().next_batch(filler.generated)]
    assert batch == [i for i in order if int(i[1:]) % 3][:8]
    assert filler.dropped == sum(1 for i in order if int(i[1:]) % 3 == 0)


def test_fill_groups_gives_up_after_max_rounds():
    stream = PromptStream([Problem(f"p{3 * i}", "t", "0") for i in range(10)], batch_size=4, seed=0)
    with pytest.raises(TooManyRounds, match="3 generation round"):
        fill_groups(stream.next_batch, _fake_rollout(2), target=4, group_size=2, max_rounds=3)
