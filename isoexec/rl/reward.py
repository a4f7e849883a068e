"""DAPO's reward: +1 / -1 from the math verifier, plus the soft overlong penalty.

Correctness is decided by skyrl-gym's ``aime`` environment scorer
(``skyrl_gym.envs.aime.utils.compute_score``), the DAPO math verifier that verl ships as
``math_dapo``. We call it rather than re-implement it, because matching the reference runs'
reward bit for bit is the point; what it does (so that tests and readers know):

* it looks only at the last 300 characters of the response;
* it takes the LAST match of ``Answer\\s*:\\s*(...)`` (case-insensitive) up to a newline or ``<``;
* it normalises both sides (drops ``$``, spaces, ``\\boxed{}``/``\\text{}`` wrappers, units
  words, everything up to a last ``=``; ``1,000`` -> ``1000``) and compares the strings exactly:
  ``42`` == ``$42$`` == ``\\boxed{42}``, but ``42.0`` != ``42`` and ``42.`` != ``42``;
* it returns +1.0 when they match, -1.0 otherwise (a response with no Answer line scores -1).

The overlong penalty (DAPO, "soft overlong punishment") discourages running into the length
cap without a cliff: with ``L_max`` the response-length limit and ``L_cache`` the soft band below
it, a response of ``n`` tokens gets

*  0                                     if n <= L_max - L_cache
*  ((L_max - L_cache) - n) / L_cache     if L_max - L_cache < n <= L_max   (0 down to -1)
* -1                                     if n > L_max

and it is ADDED to the correctness reward (DAPO used L_max = 20480, L_cache = 4096).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable


@lru_cache(maxsize=1)
def _scorer() -> Callable[[str, str], dict]:
    """skyrl-gym's DAPO scorer, imported once (importing skyrl_gym pulls in pandas: ~0.5 s)."""
    try:
        from skyrl_gym.envs.aime.utils import compute_score
    except ImportError as e:
        raise ImportError("the DAPO reward needs skyrl-gym (its `aime` verifier): "
                          "pip install 'isoexec[rl]'") from e
    return compute_score


def verify(response_text: str, ground_truth: str) -> tuple[bool, str]:
    """(correct, the normalised prediction the verifier extracted, "[INVALID]" if none)."""
    out = _scorer()(response_text, str(ground_truth))
    return bool(out["acc"]), str(out["pred"])


def overlong_penalty(length: int, L_max: int, L_cache: int) -> float:
    """DAPO's soft length penalty in [-1, 0] (see the module docstring).

    ``L_cache = 0`` is a hard cap: 0 up to ``L_max``, -1 beyond.
    """
    if length < 0:
        raise ValueError(f"overlong_penalty: length must be >= 0, got {length}")
    if not 0 <= L_cache <= L_max:
        raise ValueError(f"overlong_penalty: need 0 <= L_cache <= L_max, got L_cache={L_cache}, L_max={L_max}")
    expected = L_max - L_cache
    if length <= expected:
        return 0.0
    if length <= L_max:
        return (expected - length) / L_cache
    return -1.0


def reward(response_text: str, ground_truth: str, length: int, L_max: int,
           L_cache: int) -> tuple[float, bool]:
    """(DAPO reward = verifier score in {+1, -1} + overlong penalty, correct).

    ``length`` is the response length in tokens (what the engine generated, EOS included if the
    engine counts it), not characters. ``correct`` is returned separately because DAPO's dynamic
    sampling filters groups on accuracy, not on the penalised reward.
    """
    penalty = overlong_penalty(length, L_max, L_cache)   # validates the lengths first
    out = _scorer()(response_text, str(ground_truth))
    return float(out["score"]) + penalty, bool(out["acc"])
