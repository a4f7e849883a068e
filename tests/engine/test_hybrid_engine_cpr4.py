"""CPR version 4 (impl ``gdn_cpr_chunk``, isoexec_kernels/gdn_core/cpr4_api.py) bound through the
IsoExec composition, end to end on the CPU: the hybrid engine allocates the chunk-form state, and every sampled
token's engine logprob equals the trainer's score bit for bit, with prefill split inside GDN chunks
and decode across chunk boundaries (the kernels' own tests: tests/kernels/test_gdn_cpr4.py)."""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

from isoexec.compose import build_contract, load_model_config  # noqa: E402
from isoexec.engine import Engine, EngineConfig  # noqa: E402
from isoexec.gates.engine_gates import verify_engine_logprobs  # noqa: E402
from isoexec.model import build_model  # noqa: E402
from isoexec.model.hybrid import contract_gdn_chunk_form  # noqa: E402

from engine_fixtures import sampled_params, seeded_prompts  # noqa: E402

CFG = load_model_config("hybrid_tiny")["hf_config"]


def _cpr4_contract(arch: str = "cpu"):
    """The shipped IsoExec composition, whose Gated DeltaNet core is ``gdn_cpr_chunk``."""
    return build_contract("hybrid", "isoexec", arch, "hybrid_tiny")


def test_the_isoexec_contract_on_the_chunk_form_core_gives_the_engine_its_state_and_the_trainers_bits():
    c = _cpr4_contract()
    assert contract_gdn_chunk_form(c)
    assert contract_gdn_chunk_form(build_contract("hybrid", "isoexec_tp4", "cpu", "hybrid_tiny"))
    assert contract_gdn_chunk_form(build_contract("hybrid_moe", "isoexec", "cpu", "hybrid_moe_tiny")), \
        "both GDN families on version 4"
    m = build_model("hybrid", CFG, dtype=torch.float32).init_random(0)
    m.install(c)
    gdn, _ = m.allocate_recurrent_state(3)
    assert all(st.buf_q is not None and st.buf_vn is not None for st in gdn)
    assert all(st.buf_v.dtype == torch.float32 for st in gdn), "the values kept in the model dtype"
    assert all(st.boundary_op is None and st.buf_vn_op is None for st in gdn), "fp32 values: no bf16 copies"
    ps = seeded_prompts(3, 6, 150, CFG["vocab_size"])
    engine = Engine(m, c, EngineConfig(max_num_seqs=4, num_pages=256, max_num_batched_tokens=40, chunk_align=8))
    results = engine.generate(ps, sampled_params(len(ps), 70, seed0=1000))
    assert max(len(p) for p in ps) > 40, "prefill must be split"
    assert max(len(r.ids) for r in results) > 64, "decode must cross a chunk boundary"
    rep = verify_engine_logprobs(m, results)
    assert rep.compared == sum(len(r.ids) for r in results) > 0
    assert rep.differing == 0



@pytest.mark.gpu
def test_chunk_form_core_in_decode_graphs_with_padded_lanes_equals_eager_and_the_trainer_bitwise():
    """On CUDA (bf16, the Triton twin, decode by rows): decode CUDA graphs whose padded lanes share
    the scratch slot give the eager engine's tokens and logprobs, and those equal the trainer's."""
    from engine_fixtures import same_results
    from isoexec.envinfo import runtime_arch

    c = _cpr4_contract(runtime_arch())
    m = build_model("hybrid", CFG, dtype=torch.bfloat16, device="cuda").init_random(1)
    m.install(c)
    assert m.allocate_recurrent_state(1)[0][0].buf_v.dtype == torch.bfloat16, "bf16 values kept in bf16"
    ps = seeded_prompts(5, 11, 90, CFG["vocab_size"])            # 11 lanes: a padded bucket (16)
    cfg = dict(max_num_seqs=16, num_pages=256, max_num_batched_tokens=256, max_model_len=256)
    eager = Engine(m, c, EngineConfig(cuda_graphs=False, **cfg)).generate(ps, sampled_params(len(ps), 80, seed0=1000))
    graphed_engine = Engine(m, c, EngineConfig(cuda_graphs=True, **cfg))
    graphed = graphed_engine.generate(ps, sampled_params(len(ps), 80, seed0=1000))
    assert graphed_engine.runner.graph_replays > 0
    same_results(eager, graphed)
    assert verify_engine_logprobs(m, eager).differing == 0
