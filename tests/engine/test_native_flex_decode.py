"""The native composition's engine decode on flex_attention (impl ``torch_flex_decode``, pinned by
configs/compositions/native.yaml) generates what the page-gather native engine (impl
``torch_sdpa``) generates: same greedy tokens, logprobs at fp32 tolerance. On a GPU flex runs
compiled and captured in the engine's decode graphs; on a CPU the impl takes the page gather."""

import sys

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

from engine_fixtures import TINY, random_prompts  # noqa: E402
from isoexec.compose import build_contract  # noqa: E402
from isoexec.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from isoexec.model import build_model  # noqa: E402
from isoexec.paths import configs_dir  # noqa: E402

ENTRY = "{region: [attn_core], impl: torch_flex_decode, families: [dense]}"


def _native_with_gather_decode(tmp_path) -> str:
    text = (configs_dir() / "compositions" / "native.yaml").read_text()
    assert ENTRY in text
    path = tmp_path / "native_gather.yaml"
    path.write_text(text.replace(ENTRY, ENTRY.replace("torch_flex_decode", "torch_sdpa")))
    return str(path)


def _generate(composition: str, arch: str, device: str, graphs: bool, want_impl: str):
    c = build_contract("dense", composition, arch)
    assert {e.impl.id for e in c.composition if e.region == ("attn_core",)} == {want_impl}
    m = build_model("dense", TINY, dtype=torch.float32, device=device).init_random(4)
    m.install(c)
    cfg = EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, num_pages=64, cuda_graphs=graphs)
    engine = Engine(m, c, cfg, trainer_contract=c)
    assert (engine.runner.graphs is not None) == graphs
    prompts = random_prompts(torch.Generator().manual_seed(3), 5, 1, 40)   # 5 > 4: batches 4, 3, 1 ...
    return engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))


def _same_tokens_close_logprobs(a, b):
    for x, y in zip(a, b):
        assert x.ids == y.ids and len(x.ids) == 6
        torch.testing.assert_close(y.logprobs, x.logprobs, rtol=0, atol=1e-5)


def test_native_composition_pins_flex_decode_and_its_cpu_engine_generates_what_the_gather_path_does(tmp_path):
    flex = _generate("native", "cpu", "cpu", False, "torch_flex_decode")
    gather = _generate(_native_with_gather_decode(tmp_path), "cpu", "cpu", False, "torch_sdpa")
    _same_tokens_close_logprobs(gather, flex)


@pytest.mark.gpu
def test_native_flex_decode_is_captured_in_the_decode_graphs_and_matches_the_gather_path(tmp_path):
    """fp32 on CUDA: the gather side runs padded SDPA eagerly, the flex side compiled flex in the
    engine's decode graphs (capture refused on any host sync)."""
    from isoexec.envinfo import runtime_arch

    gather = _generate(_native_with_gather_decode(tmp_path), runtime_arch(), "cuda", False, "torch_sdpa")
    flex = _generate("native", runtime_arch(), "cuda", True, "torch_flex_decode")
    _same_tokens_close_logprobs(gather, flex)
