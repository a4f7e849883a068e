"""End-to-end engine gates on a tiny dense model (CPU, fp32 and bf16).

Every comparison is bitwise (int32 views of the fp32 logprobs via compare_bits, 0 differing):
(a) generate-then-verify against the trainer's score_logprobs, (b) a needle request alone vs
inside a batch with staggered arrivals, (c) bs1 vs bsN, (d) preemption by recompute vs an
unconstrained run, (e) small vs large token budget (chunked prefill), (f) weight update, and
(g) the native composition as negative control (stock CPU kernels are batch-variant).
"""

import random

import pytest
import torch

from engine_fixtures import contract, random_prompts, same_results, tiny_model, verify
from isoexec.contract import offer
from isoexec.engine import Engine, EngineConfig, SamplingParams
from isoexec.errors import BindingRefused, ContractMismatch
from isoexec.gates.compare import compare_bits
from isoexec.gates.engine_gates import run_staggered

DTYPES = [torch.float32, torch.bfloat16]


def _engine(model, composition="isoexec", **kw):
    cfg = dict(max_num_batched_tokens=64, max_num_seqs=32, num_pages=128, chunk_align=16)
    cfg.update(kw)
    c = contract(composition)
    return Engine(model, c, EngineConfig(**cfg), trainer_contract=c)


def _mixed_params(n, seed=0, max_tokens=(4, 10)):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 4
        out.append(SamplingParams(temperature=[0.0, 1.0, 0.7, 1.3][kind], top_k=[0, 0, 20, 0][kind],
                                  top_p=[1.0, 1.0, 1.0, 0.8][kind], seed=rng.randrange(2 ** 40),
                                  max_tokens=rng.randint(*max_tokens), logprobs=2 if kind == 1 else 0))
    return out



def _record_batches(engine):
    log = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        if batch is not None:
            log.append((batch.is_decode, list(batch.num_tokens), [s.num_computed for s in batch.seqs]))
        return batch

    engine.scheduler.schedule = recording
    return log


# ------------------------------------------------------------------------------------ (a)
@pytest.mark.parametrize("dtype", DTYPES)
def test_generate_then_verify_logprobs_bitwise(dtype):
    model = tiny_model("isoexec", dtype)
    prompts = random_prompts(torch.Generator().manual_seed(10), 10, 1, 40)
    results = _engine(model).generate(prompts, _mixed_params(10, seed=1))
    assert all(len(r.ids) >= 1 and r.finish_reason == "length" for r in results)
    rep = verify(model, results)
    assert rep.compared == sum(len(r.ids) for r in results)
    assert rep.differing == 0, rep
    # top-n logprobs come from the same region: the sampled token's entry (if listed) is the same bits
    for r in results:
        for tok, lp, (ids, lps) in zip(r.ids, r.logprobs, r.top_logprobs or []):
            if tok in ids:
                assert compare_bits(lps[ids.index(tok)].reshape(1), lp.reshape(1)).differing == 0


# ------------------------------------------------------------------------------------ (b)
@pytest.mark.parametrize("dtype", DTYPES)
def test_needle_in_batch_logprobs_bitwise(dtype):
    model = tiny_model("isoexec", dtype)
    gen = torch.Generator().manual_seed(20)
    rng = random.Random(20)
    needle = random_prompts(gen, 1, 20, 30)[0]
    needle_params = SamplingParams(temperature=0.9, top_k=60, seed=1234, max_tokens=10)
    alone = run_staggered(_engine(model), [(0, needle, needle_params, 4242)])[4242]
    assert verify(model, [alone]).differing == 0

    n = 40
    prompts = random_prompts(gen, n - 1, 1, 48)
    params = _mixed_params(n - 1, seed=21, max_tokens=(1, 14))
    requests = [(rng.randint(0, 6), p, sp, i) for i, (p, sp) in enumerate(zip(prompts, params))]
    requests.insert(rng.randrange(n), (3, needle, needle_params, 4242))   # joins mid-flight
    engine = _engine(model, max_num_seqs=48, max_num_batched_tokens=96)
    log = _record_batches(engine)
    inside = run_staggered(engine, requests)
    assert any(not d and 1 in counts for d, counts, _ in log), "no mixed prefill+decode step happened"
    assert max(len(c) for _, c, _ in log) >= 16, "the batch never grew large"
    same_results([alone], [inside[4242]])
    assert verify(model, list(inside.values())).differing == 0


# ------------------------------------------------------------------------------------ (c)
def test_bs1_equals_bsN_bitwise(iso_bf16):
    prompts = random_prompts(torch.Generator().manual_seed(30), 5, 2, 30)
    params = _mixed_params(5, seed=31, max_tokens=(5, 8))
    together = _engine(iso_bf16).generate(prompts, params)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        alone = _engine(iso_bf16).generate([p], sp, request_ids=[i])
        same_results(alone, [together[i]])


# ------------------------------------------------------------------------------------ (d)
@pytest.mark.parametrize("dtype", DTYPES)
def test_preemption_by_recompute_bitwise(dtype):
    model = tiny_model("isoexec", dtype)
    prompts = random_prompts(torch.Generator().manual_seed(40), 10, 8, 30)
    params = _mixed_params(10, seed=41, max_tokens=(8, 12))
    free = _engine(model).generate(prompts, params)
    tight = _engine(model, num_pages=14, page_size=4, chunk_align=4, max_num_batched_tokens=32)
    squeezed = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0 and any(r.num_preemptions for r in squeezed)
    same_results(free, squeezed)
    assert verify(model, squeezed).differing == 0


# ------------------------------------------------------------------------------------ (e)
def test_chunked_prefill_small_budget_equals_large_budget_bitwise(iso_fp32):
    prompts = random_prompts(torch.Generator().manual_seed(50), 6, 30, 70)
    params = _mixed_params(6, seed=51, max_tokens=(3, 6))
    big = _engine(iso_fp32, max_num_batched_tokens=1024, chunk_align=64).generate(prompts, params)
    small = _engine(iso_fp32, max_num_batched_tokens=16, chunk_align=8)
    log = _record_batches(small)
    chunked = small.generate(prompts, params)
    assert all(sum(c) <= 16 for _, c, _ in log)
    assert any(start > 0 and n > 1 for _, c, starts in log for n, start in zip(c, starts)), "no prompt was chunked"
    same_results(big, chunked)


def test_prefill_interval_keeps_steps_decode_only_and_changes_no_bit(iso_fp32):
    """Staggered arrivals: with a prefill interval of 3, prefill chunks join a step only after 3
    decode-only steps while decodes run (or when they fill the step), and every token and
    logprob stays the same."""
    gen = torch.Generator().manual_seed(60)
    prompts = random_prompts(gen, 10, 3, 30)
    params = _mixed_params(10, seed=61, max_tokens=(6, 12))

    def run(interval):
        e = _engine(iso_fp32, max_num_batched_tokens=32, chunk_align=8, prefill_interval=interval)
        log = _record_batches(e)
        out = {}
        for step in range(400):
            if step < 10:                       # one arrival per step
                e.add_request(prompts[step], params[step], 500 + step)
            for r in e.step():
                out[r.request_id] = r
            if step >= 10 and not e.has_unfinished():
                break
        return [out[k] for k in sorted(out)], log

    every, log0 = run(0)
    held, log3 = run(3)
    same_results(every, held)
    assert verify(iso_fp32, held).differing == 0
    # after each step with a prefill chunk, the next 3 steps are decode-only whenever decodes ran,
    # unless the prefill filled the step (within one chunk_align of the 32-token budget)
    prefill_steps = [i for i, (dec, _, _) in enumerate(log3) if not dec]
    for a, b in zip(prefill_steps, prefill_steps[1:]):
        assert b - a > 3 or all(not dec for dec, _, _ in log3[a:b + 1]) \
            or sum(log3[b][1]) > 32 - 8, (a, b, log3[b])
    assert sum(not dec for dec, _, _ in log3) < sum(not dec for dec, _, _ in log0)


# ------------------------------------------------------------------------------------ (f)
def test_weight_update_then_generate_then_verify_bitwise():
    model = tiny_model("isoexec", torch.float32, seed=1)
    trainer = tiny_model("isoexec", torch.float32, seed=2)          # the trainer's new weights
    engine = _engine(model)
    prompts = random_prompts(torch.Generator().manual_seed(60), 6, 2, 30)
    params = _mixed_params(6, seed=61, max_tokens=(4, 8))
    before = engine.generate(prompts, params)
    # a request in flight during the update is recomputed from scratch with the new weights
    engine.add_request(prompts[0], params[0], request_id=99)
    engine.step()
    ptrs = [p.data_ptr() for p in model.parameters()]
    result = engine.update_weights(trainer.state_dict(), trainer_contract=trainer.contract)
    assert result.accepted and engine.weight_version == 1
    assert [p.data_ptr() for p in model.parameters()] == ptrs, "weights must be copied in place"
    live = engine._live[99]
    assert live.num_computed == 0 and live.block_table == []
    while engine.has_unfinished():
        engine.step()
    after = engine.generate(prompts, params)
    assert any(a.ids != b.ids for a, b in zip(before, after))
    assert verify(trainer, after).differing == 0
    # and from a module, with the handshake remembered from the last accepted trainer contract
    engine.update_weights(tiny_model("isoexec", torch.float32, seed=1))
    same_results(before, engine.generate(prompts, params))


def test_weight_update_with_a_different_contract_is_refused_and_changes_nothing(iso_fp32):
    engine = _engine(iso_fp32)
    snapshot = {k: v.clone() for k, v in iso_fp32.state_dict().items()}
    other = tiny_model("native", torch.float32, seed=5)
    with pytest.raises(ContractMismatch, match="numerical_policy"):
        engine.update_weights(other.state_dict(), trainer_contract=other.contract)
    for k, v in iso_fp32.state_dict().items():
        assert compare_bits(v, snapshot[k]).differing == 0, k
    assert engine.weight_version == 0


# ------------------------------------------------------------------------------------ (g)
def test_native_generate_then_verify_is_not_bitwise():
    """Negative control: the stock CPU kernels give the engine's rows other bits than the
    trainer's packed forward. fp32 on purpose: MKL's fp32 GEMM for M=1 (decode) rounds
    differently from M>1 (thousands of elements differ for K=32), while bf16 F.linear happens to
    agree at these tiny shapes on this CPU, which would make a bf16 control vacuous."""
    model = tiny_model("native", torch.float32)
    prompts = random_prompts(torch.Generator().manual_seed(10), 10, 1, 40)
    results = _engine(model, "native").generate(prompts, _mixed_params(10, seed=1))
    rep = verify(model, results)
    assert rep.differing > 0, "native composition matched bitwise: the control proves nothing here"
    assert float(rep.max_abs_diff) < 1e-3      # different bits, same numbers at tolerance


# ------------------------------------------------------------------------------------ contract
def test_engine_start_refuses_a_trainer_contract_with_another_numerical_policy(iso_fp32):
    with pytest.raises(ContractMismatch, match="handshake refused"):
        Engine(iso_fp32, contract("isoexec"), EngineConfig(), trainer_contract=contract("native"))
    e = Engine(iso_fp32, contract("isoexec"), EngineConfig(), trainer_contract=offer(contract("isoexec")))
    assert e.handshake_result.accepted and not e.handshake_result.overridden


def test_engine_refuses_a_model_not_installed_with_its_contract(iso_fp32):
    with pytest.raises(BindingRefused, match="install"):
        Engine(iso_fp32, contract("native"))
    from isoexec.model import build_model
    from engine_fixtures import TINY

    with pytest.raises(BindingRefused, match="no contract installed"):
        Engine(build_model("dense", TINY), contract("isoexec"))


# ------------------------------------------------------------------------------------ behaviour
def test_stop_token_finishes_with_reason_stop(iso_fp32):
    prompt = [3, 14, 15, 92, 65]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    ref = _engine(iso_fp32).generate([prompt], greedy)[0]
    stop = ref.ids[2]
    first = ref.ids.index(stop)
    r = _engine(iso_fp32).generate([prompt], SamplingParams(temperature=0.0, max_tokens=8,
                                                            stop_token_ids=[stop]))[0]
    assert r.finish_reason == "stop" and r.ids == ref.ids[:first + 1]
    assert compare_bits(r.logprobs, ref.logprobs[:first + 1]).differing == 0


def test_generate_is_reproducible_and_seeds_matter(iso_fp32):
    prompts = random_prompts(torch.Generator().manual_seed(70), 4, 3, 12)
    a = _engine(iso_fp32).generate(prompts, SamplingParams(seed=1, max_tokens=6))
    b = _engine(iso_fp32).generate(prompts, SamplingParams(seed=1, max_tokens=6))
    c = _engine(iso_fp32).generate(prompts, SamplingParams(seed=2, max_tokens=6))
    same_results(a, b)
    assert any(x.ids != y.ids for x, y in zip(a, c))


def test_progress_callback_and_stderr_line(iso_fp32, capsys):
    seen = []
    engine = _engine(iso_fp32, log_every=2)
    engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=5), on_progress=seen.append)
    assert [p.step for p in seen] == list(range(1, len(seen) + 1))
    assert seen[-1].finished == 2 and seen[-1].total == 2 and seen[-1].generated_tokens == 10
    err = capsys.readouterr().err.strip().splitlines()
    assert err and all(line.startswith("isoexec engine: step ") for line in err)
    assert "done 2/2" in err[-1]


def test_add_request_refuses_what_can_never_fit(iso_fp32):
    engine = _engine(iso_fp32, num_pages=2, page_size=4, chunk_align=4)
    with pytest.raises(ValueError, match="raise num_pages"):
        engine.add_request(list(range(1, 8)), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_model_len"):
        _engine(iso_fp32, max_model_len=8).add_request(list(range(8)))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([1, 300])
    engine.add_request([1, 2], SamplingParams(max_tokens=2), request_id=5)
    with pytest.raises(ValueError, match="already live"):
        engine.add_request([1, 2], SamplingParams(max_tokens=2), request_id=5)
    with pytest.raises(RuntimeError, match="drain"):
        engine.generate([[1]])
