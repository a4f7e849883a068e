"""The unified hybrid model (Qwen3.5 text) matches transformers 5.17 Qwen3_5ForCausalLM on the same
weights, loads its checkpoints, and gives the same bits in every case under the IsoExec composition."""

import sys

sys.modules.setdefault("fla", None)  # keep transformers off FLA's GPU kernels (docs/gpu_notes.md)

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402

from isoexec.compose import build_contract  # noqa: E402
from isoexec.errors import BindingRefused  # noqa: E402
from isoexec.model import (ForwardBatch, KVCache, build_model, load_checkpoint,  # noqa: E402
                           load_from_hf_model, load_hybrid_checkpoint)
from isoexec.model.loading import CheckpointError, to_hf_state_dict  # noqa: E402

# GDN, GDN, attention, GDN: an attention layer between recurrent ones, GQA in both mixers
# (4 v heads over 2 k heads; 4 q heads over 2 kv heads), partial rotary 0.25 with the 9B's M-RoPE
# keys (mrope sections sum to rotary_dim / 2).
TINY = dict(model_type="qwen3_5_text", vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            hidden_act="silu", max_position_embeddings=512, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                             "mrope_interleaved": True, "mrope_section": [2, 1, 1]},
            tie_word_embeddings=True)


def _hf(cfg, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    d = {k: v for k, v in cfg.items() if k != "model_type"}
    m = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**d)).to(dtype).eval()
    with torch.no_grad():  # non-trivial norms (a skipped or un-centred norm would show) and conv taps
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            if n.endswith("conv1d.weight"):
                p.mul_(3.0)
    return m


def _ours(hf, cfg, composition, dtype=torch.float32):
    m = build_model("hybrid", cfg, dtype=dtype)
    load_from_hf_model(m, hf)
    m.install(build_contract("hybrid", composition, "cpu"))
    return m


def _seqs(lens, vocab, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


def _bits(t):
    return t.detach().contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


# ------------------------------------------------------------------------------ vs transformers


@pytest.mark.parametrize("composition", ["isoexec", "native"])
@pytest.mark.parametrize("tied", [True, False])
def test_hybrid_logprobs_match_transformers_fp32(composition, tied):
    cfg = dict(TINY, tie_word_embeddings=tied)
    hf = _hf(cfg)
    ours = _ours(hf, cfg, composition)
    lens = [70, 9, 131]  # crosses the 64-token chunk boundaries of the GDN core
    seqs = _seqs(lens, cfg["vocab_size"])
    with torch.no_grad():
        ref = torch.cat([torch.log_softmax(hf(s[None]).logits[0].float(), -1) for s in seqs])
        batch = ForwardBatch.packed(lens, "trainer_score", "cpu")
        got = torch.log_softmax(ours.logits(ours.hidden_states(torch.cat(seqs), batch), "trainer_score").float(), -1)
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 1e-5, err


def test_hybrid_logprobs_match_transformers_bf16():
    hf = _hf(TINY, torch.bfloat16)
    ours = _ours(hf, TINY, "isoexec", torch.bfloat16)
    lens = [40, 17]
    seqs = _seqs(lens, TINY["vocab_size"])
    with torch.no_grad():
        ref = torch.cat([torch.log_softmax(hf(s[None]).logits[0].float(), -1) for s in seqs])
        batch = ForwardBatch.packed(lens, "trainer_score", "cpu")
        got = torch.log_softmax(ours.logits(ours.hidden_states(torch.cat(seqs), batch), "trainer_score").float(), -1)
    assert ((got - ref).norm() / ref.norm()).item() < 3e-2


def test_mrope_sections_are_plain_rope_for_text_positions():
    """For text every M-RoPE axis carries the token position, so transformers' interleaved M-RoPE
    equals plain partial RoPE: the same weights give the same logits with or without the mrope keys."""
    plain = dict(TINY, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    a, b = _hf(TINY), _hf(plain)
    b.load_state_dict(a.state_dict())
    s = _seqs([50], TINY["vocab_size"])[0][None]
    with torch.no_grad():
        la, lb = a(s).logits, b(s).logits
    assert torch.equal(_bits(la), _bits(lb))
    assert a.model.rotary_emb.mrope_section == [2, 1, 1]  # the mrope path was really taken


# ------------------------------------------------------------------------------ checkpoints


def test_safetensors_checkpoint_round_trip(tmp_path):
    hf = _hf(dict(TINY, tie_word_embeddings=False))
    cfg = dict(TINY, tie_word_embeddings=False)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")  # sharded: index + several files
    assert (tmp_path / "model.safetensors.index.json").exists()
    a = build_model("hybrid", cfg)
    load_hybrid_checkpoint(a, tmp_path)
    b = build_model("hybrid", cfg)
    load_from_hf_model(b, hf)
    c = build_model("hybrid", cfg)
    load_checkpoint(c, tmp_path)
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(_bits(p), _bits(q)) and torch.equal(_bits(p), _bits(r)), n
    # back to transformers: the exported state dict loads strictly and reproduces every tensor
    exported = to_hf_state_dict(a)
    fresh = _hf(cfg, seed=1)
    fresh.load_state_dict(exported, strict=True)
    for n, t in hf.state_dict().items():
        assert torch.equal(_bits(fresh.state_dict()[n]), _bits(t)), n


def test_multimodal_checkpoint_names_load(tmp_path):
    """Qwen3.5 releases are multimodal: the text model sits under model.language_model.* next to
    model.visual.* and mtp.* tensors, which the text model skips."""
    from safetensors.torch import save_file

    hf = _hf(TINY)
    sd = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v.clone().contiguous()
          for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    sd["model.visual.patch_embed.proj.weight"] = torch.zeros(3, 3)
    sd["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(sd, str(tmp_path / "model.safetensors"))
    a, b = build_model("hybrid", TINY), build_model("hybrid", TINY)
    load_hybrid_checkpoint(a, tmp_path)
    load_from_hf_model(b, hf)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(_bits(p), _bits(q)), n


def test_checkpoint_errors_name_the_problem(tmp_path):
    from safetensors.torch import save_file

    hf = _hf(TINY)
    m = build_model("hybrid", TINY)
    with pytest.raises(CheckpointError, match="not found"):
        load_hybrid_checkpoint(m, tmp_path / "missing")
    wrong = dict(TINY, linear_num_value_heads=2)
    with pytest.raises(CheckpointError, match="has shape"):
        load_from_hf_model(build_model("hybrid", wrong), hf)
    sd = {k: v.clone().contiguous() for k, v in hf.state_dict().items()
          if k != "model.layers.3.linear_attn.A_log" and k != "lm_head.weight"}
    (tmp_path / "a").mkdir()
    save_file(sd, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing, first 'model.layers.3.linear_attn.A_log'"):
        load_hybrid_checkpoint(m, tmp_path / "a")
    sd = {k: v.clone().contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    sd["model.layers.0.linear_attn.extra.weight"] = torch.zeros(2)
    (tmp_path / "b").mkdir()
    save_file(sd, str(tmp_path / "b" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="does not know, first 'model.layers.0.linear_attn.extra.weight'"):
        load_hybrid_checkpoint(m, tmp_path / "b")


def test_contract_of_other_family_is_refused():
    m = build_model("hybrid", TINY)
    with pytest.raises(BindingRefused, match="contract is for the dense family"):
        m.install(build_contract("dense", "isoexec", "cpu"))


# ------------------------------------------------------------------------------ case parity


def _engine(m, kv_pages=64, page_size=16, slots=6):
    cfg = m.cfg
    kv = KVCache.allocate(cfg.num_kv_layers, kv_pages, page_size, cfg.num_kv_heads, cfg.head_dim,
                          m.embed.dtype, "cpu")
    gdn, conv = m.allocate_recurrent_state(slots)
    return kv, gdn, conv


def _pages(lens, page_size, total, seed):
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
    out, i = [], 0
    for n in lens:
        k = -(-n // page_size)
        out.append(perm[i:i + k])
        i += k
    return out


def _run_engine(m, seqs, pieces, slots, kv, gdn, conv, page_size=16, seed=0):
    """Feed each sequence in ``pieces[b]`` (list of (case, length)) in lock step: step j runs the
    j-th piece of every sequence that has one, in one batch. Returns per-sequence hidden rows."""
    tables = _pages([len(s) for s in seqs], page_size, kv.num_pages, seed)
    done = [0] * len(seqs)
    outs = [[] for _ in seqs]
    for j in range(max(len(p) for p in pieces)):
        for case in ("engine_prefill", "engine_decode"):
            bs = [b for b in range(len(seqs)) if j < len(pieces[b]) and pieces[b][j][0] == case]
            if not bs:
                continue
            lens = [pieces[b][j][1] for b in bs]
            ids = torch.cat([seqs[b][done[b]:done[b] + n] for b, n in zip(bs, lens)])
            fb = ForwardBatch.paged(case, kv, [tables[b] for b in bs], [done[b] for b in bs], lens, "cpu",
                                    gdn_states=gdn, conv_states=conv, state_slots=[slots[b] for b in bs])
            with torch.no_grad():
                h = m.hidden_states(ids, fb)
            for b, part in zip(bs, h.split(lens)):
                outs[b].append(part)
                done[b] += part.shape[0]
    return [torch.cat(o) for o in outs]


def _random_pieces(n, g, max_pieces=4):
    cuts = sorted(set(torch.randint(1, max(n, 2), (max_pieces - 1,), generator=g).tolist()) - {0, n})
    bounds = [0] + [c for c in cuts if c < n] + [n]
    return [("engine_prefill", b - a) for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.fixture(scope="module")
def iso_model():
    m = build_model("hybrid", TINY).init_random(seed=5)
    m.install(build_contract("hybrid", "isoexec", "cpu"))
    return m


def test_trainer_fwd_score_prefill_splits_and_decode_bitwise(iso_model):
    m = iso_model
    lens = [70, 9, 131]
    seqs = _seqs(lens, TINY["vocab_size"], seed=7)
    ids = torch.cat(seqs)
    with torch.no_grad():
        score = m.hidden_states(ids, ForwardBatch.packed(lens, "trainer_score", "cpu"))
    with torch.enable_grad():
        fwd = m.hidden_states(ids, ForwardBatch.packed(lens, "trainer_fwd", "cpu"))
    assert fwd.requires_grad
    assert torch.equal(_bits(fwd), _bits(score)), "trainer_fwd vs trainer_score"
    want = score.split(lens)
    g = torch.Generator().manual_seed(11)
    slots = [4, 0, 2]
    # prefill split at random points, several rounds of random splits
    for rnd in range(3):
        kv, gdn, conv = _engine(m)
        pieces = [_random_pieces(n, g) for n in lens]
        got = _run_engine(m, seqs, pieces, slots, kv, gdn, conv, seed=rnd)
        for b in range(len(lens)):
            assert torch.equal(_bits(got[b]), _bits(want[b])), f"round {rnd} seq {b} pieces {pieces[b]}"
    # prefill a prompt then decode the rest token by token (mixed lengths: batches shrink)
    kv, gdn, conv = _engine(m)
    prompts = [5, 1, 66]
    pieces = [[("engine_prefill", p)] + [("engine_decode", 1)] * (n - p) for p, n in zip(prompts, lens)]
    got = _run_engine(m, seqs, pieces, slots, kv, gdn, conv, seed=9)
    for b in range(len(lens)):
        assert torch.equal(_bits(got[b]), _bits(want[b])), f"decode seq {b}"
    # and the logprobs built on them agree too
    tgt = torch.randint(0, TINY["vocab_size"], (lens[2],), generator=g)
    lp_score = m.token_logprobs(want[2], tgt, "trainer_score")
    lp_dec = m.token_logprobs(got[2], tgt, "engine_decode")
    assert torch.equal(_bits(lp_score), _bits(lp_dec))


def test_reset_slot_starts_a_fresh_sequence_bitwise(iso_model):
    """A slot reused after reset gives the same bits as a fresh pool (state really cleared)."""
    m = iso_model
    a, b = _seqs([20, 20], TINY["vocab_size"], seed=13)
    kv, gdn, conv = _engine(m)
    first = _run_engine(m, [a], [[("engine_prefill", 20)]], [1], kv, gdn, conv)[0]
    kv2, _, _ = _engine(m)
    dirty = _run_engine(m, [b], [[("engine_prefill", 20)]], [1], kv2, gdn, conv)[0]  # slot 1 not reset
    m.reset_recurrent_state(gdn, conv, torch.tensor([1]))
    kv3, _, _ = _engine(m)
    clean = _run_engine(m, [b], [[("engine_prefill", 20)]], [1], kv3, gdn, conv)[0]
    kv4, gdn4, conv4 = _engine(m)
    fresh = _run_engine(m, [b], [[("engine_prefill", 20)]], [1], kv4, gdn4, conv4)[0]
    assert torch.equal(_bits(clean), _bits(fresh))
    assert not torch.equal(_bits(dirty), _bits(fresh))
    assert first.shape == fresh.shape


def test_engine_batch_without_recurrent_state_is_refused(iso_model):
    m = iso_model
    kv, _, _ = _engine(m)
    fb = ForwardBatch.paged("engine_prefill", kv, [[0]], [0], [3], "cpu")
    with pytest.raises(BindingRefused, match="needs state_slots"):
        m.hidden_states(torch.tensor([1, 2, 3]), fb)


# ------------------------------------------------------------------------------ training


@pytest.mark.parametrize("composition", ["isoexec", "native"])
def test_gradients_reach_every_parameter(composition):
    m = build_model("hybrid", dict(TINY, tie_word_embeddings=False)).init_random(seed=2)
    m.install(build_contract("hybrid", composition, "cpu"))
    lens = [70, 12]
    seqs = _seqs(lens, TINY["vocab_size"], seed=17)
    ids = torch.cat(seqs)
    targets = torch.cat([s.roll(-1) for s in seqs])
    h = m.hidden_states(ids, ForwardBatch.packed(lens, "trainer_fwd", "cpu"))
    m.token_logprobs(h, targets, "trainer_fwd").sum().backward()
    for n, p in m.named_parameters():
        assert p.grad is not None, n
        assert torch.isfinite(p.grad).all(), n
        assert p.grad.abs().sum() > 0, n


def test_gradients_match_transformers():
    cfg = dict(TINY, tie_word_embeddings=False)
    hf = _hf(cfg)
    ours = _ours(hf, cfg, "isoexec")
    lens = [70, 12]
    seqs = _seqs(lens, cfg["vocab_size"], seed=19)
    tg = [s.roll(-1) for s in seqs]
    loss_ref = sum(torch.log_softmax(hf(s[None]).logits[0].float(), -1).gather(-1, t[:, None]).sum()
                   for s, t in zip(seqs, tg))
    loss_ref.backward()
    h = ours.hidden_states(torch.cat(seqs), ForwardBatch.packed(lens, "trainer_fwd", "cpu"))
    ours.token_logprobs(h, torch.cat(tg), "trainer_fwd").sum().backward()
    grads = {n: p.grad for n, p in ours.named_parameters()}

    class _G:  # our gradients exported under transformers' names
        cfg = ours.cfg

        def named_parameters(self):
            return grads.items()

    ours_hf = to_hf_state_dict(_G())
    for n, p in hf.named_parameters():
        err = ((ours_hf[n] - p.grad).norm() / p.grad.norm()).item()
        assert err < 1e-4, (n, err)
