"""The DAPO reward with the real skyrl-gym verifier, and the soft overlong penalty."""

from __future__ import annotations

import pytest

from isoexec.rl.reward import overlong_penalty, reward, verify

L_MAX, L_CACHE = 20, 4          # soft band: lengths 17..20


@pytest.mark.parametrize("response, truth, correct, pred", [
    ("3+4 is 7.\nAnswer: 7", "7", True, "7"),
    ("Answer: 8", "7", False, "8"),
    ("The answer is 7.", "7", False, "[INVALID]"),             # no "Answer:" line at all
    ("Answer: 8\nWait, no.\nAnswer: 7", "7", True, "7"),        # the last one counts ...
    ("Answer: 7\nWait, no.\nAnswer: 8", "7", False, "8"),       # ... in both directions
    ("Answer: $42$", "42", True, "42"),                         # $ $ is stripped
    ("Answer: \\boxed{42}", "42", True, "42"),                  # \boxed{} is unwrapped
    ("answer:42", "42", True, "42"),                            # case and spacing do not matter
    ("Answer: x = 42", "42", True, "42"),                        # text up to the last '=' dropped
    ("Answer: 1,000", "1000", True, "1000"),                    # thousands separators
    ("Answer: -17", "-17", True, "-17"),                        # negative (synthetic set)
    ("Answer: 42.0", "42", False, "42.0"),                      # string match, not numeric
    ("Answer: 42.", "42", False, "42."),
    ("Answer: 042", "42", False, "042"),
    ("Answer: 42 apples", "42", False, "42apples"),
])
def test_verifier_cases(response, truth, correct, pred):
    assert verify(response, truth) == (correct, pred)
    total, ok = reward(response, truth, length=5, L_max=L_MAX, L_cache=L_CACHE)
    assert ok is correct and total == (1.0 if correct else -1.0)


def test_only_the_tail_of_a_long_response_is_read():
    # The verifier keeps the last 300 characters: an answer followed by more text is lost.
    assert verify("Answer: 7\n" + "x" * 290, "7")[0]
    assert not verify("Answer: 7\n" + "x" * 300, "7")[0]


@pytest.mark.parametrize("length, penalty", [
    (0, 0.0), (16, 0.0),                     # up to L_max - L_cache: no penalty
    (17, -0.25), (18, -0.5), (19, -0.75),    # linear in the soft band
    (20, -1.0),                              # at L_max
    (21, -1.0), (10_000, -1.0),              # beyond
])
def test_overlong_penalty_boundaries(length, penalty):
    assert overlong_penalty(length, L_MAX, L_CACHE) == penalty


def test_overlong_penalty_dapo_sizes_and_hard_cap():
    assert overlong_penalty(16384, 20480, 4096) == 0.0
    assert overlong_penalty(16385, 20480, 4096) == -1 / 4096
    assert overlong_penalty(20480, 20480, 4096) == -1.0
    assert overlong_penalty(20, 20, 0) == 0.0 and overlong_penalty(21, 20, 0) == -1.0


@pytest.mark.parametrize("args", [(-1, 20, 4), (5, 20, 21), (5, 20, -1)])
def test_overlong_penalty_rejects_bad_lengths(args):
    with pytest.raises(ValueError):
        overlong_penalty(*args)


def test_reward_adds_penalty_to_the_verifier_score():
    assert reward("Answer: 7", "7", 16, L_MAX, L_CACHE) == (1.0, True)
    assert reward("Answer: 7", "7", 18, L_MAX, L_CACHE) == (0.5, True)
    assert reward("Answer: 6", "7", 18, L_MAX, L_CACHE) == (-1.5, False)
    assert reward("Answer: 7", "7", 21, L_MAX, L_CACHE) == (0.0, True)
    assert reward("", "7", 21, L_MAX, L_CACHE) == (-2.0, False)
