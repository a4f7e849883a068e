"""A generation round's results packed for the gather (isoexec/rl/result_gather.py) come back
with the same fields and bitwise the same fp32 logprobs, through a real gloo all_gather_object."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from isoexec.engine.sequence import Result
from isoexec.rl.result_gather import gather_results, pack_results, unpack_results


def _results(n: int, seed: int = 0) -> list[Result]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        k = 1 + i % 5
        lp = -torch.rand(k, generator=g) * 10
        lp[0] = -0.0 if i % 2 else lp[0]                      # a signed zero must keep its sign bit
        out.append(Result(request_id=3 * i, prompt=[1, 2, i], ids=list(range(i, i + k)), logprobs=lp,
                          finish_reason="stop" if i % 3 else "length",
                          top_logprobs=[([5, 6], torch.tensor([-0.5, -1.5]))] * k if i == 2 else None,
                          num_preemptions=i % 2))
    return out


def _same(a: list[Result], b: list[Result]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.request_id, x.prompt, x.ids, x.finish_reason, x.num_preemptions) == \
               (y.request_id, y.prompt, y.ids, y.finish_reason, y.num_preemptions)
        assert y.logprobs.dtype == torch.float32 and y.logprobs.device.type == "cpu"
        assert torch.equal(x.logprobs.view(torch.int32), y.logprobs.view(torch.int32))
        assert (x.top_logprobs is None) == (y.top_logprobs is None)
        for (i1, t1), (i2, t2) in zip(x.top_logprobs or [], y.top_logprobs or []):
            assert i1 == i2 and torch.equal(t1.view(torch.int32), t2.view(torch.int32))


@pytest.mark.parametrize("n", [0, 1, 7])
def test_packed_results_unpack_to_the_same_fields_and_logprob_bits(n):
    rs = _results(n)
    _same(rs, unpack_results(pack_results(rs)))


def test_logprobs_of_another_dtype_are_refused():
    r = _results(1)[0]
    r.logprobs = r.logprobs.to(torch.bfloat16)
    with pytest.raises(ValueError, match="fp32"):
        pack_results([r])


def test_a_byte_string_that_does_not_match_the_token_counts_is_refused():
    fields, data = pack_results(_results(3))
    with pytest.raises(ValueError, match="logprobs for"):
        unpack_results((fields, data + b"\0\0\0\0"))


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_gather_results_through_gloo_returns_the_ranks_results_bitwise():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        rs = _results(9, seed=4)
        (got,) = gather_results(rs)
        _same(rs, got)
        assert gather_results([]) == [[]]
    finally:
        dist.destroy_process_group()
