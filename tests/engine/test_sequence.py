"""Request lifecycle and sampling-parameter validation."""

import pytest
import torch

from isoexec.engine import SamplingParams, Sequence, Status


def test_lifecycle_counts_and_finish_reasons():
    s = Sequence(3, [5, 6, 7], SamplingParams(max_tokens=3, stop_token_ids=[9]))
    assert s.status is Status.WAITING and s.num_pending == 3 and s.num_generated == 0
    s.num_computed = 3
    s.append(4, -1.25)
    assert s.output_ids == [4] and s.num_pending == 1 and s.check_stop(100) is None
    s.append(9, -0.5)
    assert s.check_stop(100) == "stop"
    t = Sequence(4, [1], SamplingParams(max_tokens=2))
    t.append(2, -1.0)
    assert t.check_stop(100) is None
    t.append(3, -1.0)
    assert t.check_stop(100) == "length"
    u = Sequence(5, [1, 2, 3], SamplingParams(max_tokens=50))
    u.append(2, -1.0)
    assert u.check_stop(max_model_len=4) == "length"


def test_result_keeps_fp32_logprob_bits():
    s = Sequence(0, [1], SamplingParams(logprobs=1))
    vals = torch.tensor([-0.0, -1e-40, -3.4028235e38, -0.1], dtype=torch.float32)  # -0, subnormal, max
    for v in vals.tolist():
        s.append(1, v, ([1], [v]))
    s.finish_reason = "length"
    r = s.result()
    assert r.logprobs.dtype == torch.float32
    assert torch.equal(r.logprobs.view(torch.int32), vals.view(torch.int32))
    assert len(r.top_logprobs) == 4 and r.finish_reason == "length"


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                dict(max_tokens=0), dict(seed=-1), dict(seed=2 ** 63), dict(logprobs=-2)])
def test_sampling_params_refuse_bad_values(kw):
    with pytest.raises(ValueError, match="SamplingParams"):
        SamplingParams(**kw)


def test_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="empty prompt"):
        Sequence(0, [], SamplingParams())
