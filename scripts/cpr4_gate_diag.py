"""Where does CPR version 4 miss the trainer's bits in the ``case_parity`` gate of ``gdn_core`` at
Qwen3.5-9B dimensions on the H200 (a diagnosis, not a gate)?

The gate (``isoexec/gates/gdn_gates._sequence_gate``, seed 0, bf16 values) drives 1, 2, 5 and 16
sequences of up to 600 tokens through random engine prefill pieces and a few decode steps per
sequence and compares every row with the trainer's. This script replays exactly that plan (the same
generator, draws and order) and, for every differing element, reports the sequence, token, head and
Dv column and whether the engine made the row in a prefill or a decode call (with the call's piece:
the slot's fill before it, its length); and for each row decoded in a sequence's first chunk, whether
the rows of T and Vn it kept in the slot equal those of the prefill kernels on the whole sequence.
(At ``557b5710`` and ``c5cb97c`` the variants v32 (values kept in fp32), ct1 (one Dv tile per
completion program), fused (one prep launch), rows_c (C-row tiles on 2 warps) and rows_c_w4 (and the
row kernel on 4 warps) missed the same 8 rows as the then pinned decode, and at ``7d4cc88`` the
diagonal substitution by the inverse kernel's loop missed none: ``results/h200/bench/cpr4_gate_diag_*``.)
It replays the plan once per variant of the engine:

  pinned       the decode by rows as pinned, the state's values kept in bf16 (what the gate runs)
  prefix       decode by prefix (the yardstick: the native kernels on the open chunk's rows so far)

    python3 scripts/cpr4_gate_diag.py [--out $OUT/cpr4_gate_diag.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from isoexec.compose import load_model_config
from isoexec.gates.gdn_gates import _core_inputs, _cu, _dims, _max_len
from isoexec.gates.runner import BATCH_SIZES
from isoexec.bits import int_view
from isoexec_kernels.gdn_core import GDNState
from isoexec_kernels.gdn_core import cpr_chunk as C4
from isoexec_kernels.gdn_core import cpr_row_decode as RD


def _rows(**kw):
    def run(q, k, v, g, beta, slots, state, *, chunk):
        return RD.cpr4_decode_rows_triton(q, k, v, g, beta, slots, state, C4.CPR4_CHOICE, chunk=chunk, **kw)
    return run


VARIANTS = {"pinned": (_rows(), torch.bfloat16),
            "prefix": (C4.cpr4_decode_prefix_triton, torch.bfloat16)}


def replay(decode, value_dtype, device="cuda", seed=0, chunk=64, model="hybrid_qwen3p5_9b_dims"):
    """The gate's case_parity plan for gdn_core (``_sequence_gate``, family case_parity), recording
    where each engine row came from; returns the differing elements found."""
    cfg = load_model_config(model)["hf_config"]
    d = _dims(cfg)
    gen = torch.Generator().manual_seed(seed)
    make = _core_inputs(d, torch.bfloat16, gen, device)
    sizes = BATCH_SIZES["sm90"]
    max_len = _max_len(device)

    def pack(seqs):
        return [torch.cat([s[j] for s in seqs]) for j in range(len(seqs[0]))]

    found = []
    counts = [c for c in (1, 2, 5, 16, 64) if c <= max(sizes)]
    for nseq in counts[:4]:
        lens = [int(torch.randint(2, max_len, (1,), generator=gen)) for _ in range(nseq)]
        seqs = [make(n) for n in lens]
        trainer = C4.cpr4_varlen_triton(*pack(seqs), _cu(lens, device), chunk=chunk)
        # the chunk form's own rows of T and Vn for each sequence's first chunk (prefill's kernels on
        # the whole sequence from the zero state), to hold the kept rows of a decode against
        firsts = []
        for sq, n in zip(seqs, lens):
            m = min(n, chunk)
            init = torch.zeros(1, d["hv"], d["dk"], d["dv"], device=device)
            _, _, _, vn_ref, t_ref = C4._forward_triton(*(x[:m] for x in sq), [0], [m], init, chunk)
            firsts.append((t_ref[0], vn_ref[0]))     # [H, C, C], [H, C, Dv]
        state = GDNState.allocate(nseq + 3, d["hv"], d["dk"], d["dv"], device, chunk=chunk, with_q=True,
                                  value_dtype=value_dtype)
        slot_of = torch.randperm(nseq + 3, generator=gen)[:nseq].tolist()
        tails = [int(torch.randint(1, min(n, 9), (1,), generator=gen)) for n in lens]
        done = [0] * nseq
        rows = [[] for _ in range(nseq)]
        origin = [[] for _ in range(nseq)]    # per token: (kind, call, fill before, piece length)
        call = 0
        while any(done[b] < lens[b] - tails[b] for b in range(nseq)):
            live = [b for b in range(nseq) if done[b] < lens[b] - tails[b]]
            steps = {b: min(lens[b] - tails[b] - done[b], int(torch.randint(1, 2 * chunk, (1,), generator=gen)))
                     for b in live}
            ts = [torch.cat([seqs[b][j][done[b]:done[b] + steps[b]] for b in live]) for j in range(len(seqs[0]))]
            slots = torch.tensor([slot_of[b] for b in live], dtype=torch.int32, device=device)
            out = C4.cpr4_engine_triton(*ts, _cu([steps[b] for b in live], device), slots, state, chunk=chunk)
            at = 0
            for b in live:
                rows[b].append(out[at:at + steps[b]])
                origin[b] += [("prefill", call, done[b] % chunk, steps[b], len(live))] * steps[b]
                at += steps[b]
                done[b] += steps[b]
            call += 1
        for t in range(max(tails)):
            live = [b for b in range(nseq) if t < tails[b]]
            ts = [torch.cat([seqs[b][j][done[b]:done[b] + 1] for b in live]) for j in range(len(seqs[0]))]
            slots = torch.tensor([slot_of[b] for b in live], dtype=torch.int32, device=device)
            out = decode(*ts, slots, state, chunk=chunk)
            for b in live:   # the row just decoded, as kept in the slot, against the chunk form's
                r = done[b]
                if r < chunk and decode is not C4.cpr4_decode_prefix_triton:
                    s_ = slot_of[b]
                    t_ref, vn_ref = firsts[b]
                    dt = int_view(state.buf_T[s_, r].cpu()) != int_view(t_ref[:, r].cpu())
                    dv = int_view(state.buf_vn[s_, r].cpu()) != int_view(vn_ref[:, r].cpu())
                    if dt.any() or dv.any():
                        found.append({"nseq": nseq, "seq": b, "kept_row": r, "T_differing": int(dt.sum()),
                                      "T_heads": sorted({int(h) for h, _ in dt.nonzero().tolist()}),
                                      "T_cols": sorted({int(c) for _, c in dt.nonzero().tolist()})[:16],
                                      "Vn_differing": int(dv.sum()),
                                      "Vn_heads": sorted({int(h) for h, _ in dv.nonzero().tolist()})})
            for i, b in enumerate(live):
                rows[b].append(out[i:i + 1])
                origin[b].append(("decode", call, done[b] % chunk, 1, len(live)))
                done[b] += 1
            call += 1
        at = 0
        for b, n in enumerate(lens):
            got, want = torch.cat(rows[b]).cpu(), trainer[at:at + n].cpu()
            neq = int_view(got) != int_view(want)
            for tok, head in {(int(i), int(h)) for i, h, _ in neq.nonzero().tolist()}:
                cols = neq[tok, head].nonzero().flatten().tolist()
                found.append({"nseq": nseq, "seq": b, "len": n, "token": tok, "head": head, "cols": [cols[0], cols[-1]],
                              "n_cols": len(cols), "origin": origin[b][tok],
                              "max_abs": float((got[tok, head] - want[tok, head]).abs().max())})
            at += n
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", default="hybrid_qwen3p5_9b_dims")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test under TRITON_INTERPRET=1")
    a = ap.parse_args()
    res = {}
    for name, (dec, vdt) in VARIANTS.items():
        t0 = time.time()
        with torch.no_grad():
            res[name] = replay(dec, vdt, device=a.device, model=a.model)
        print(f"{name}: {len(res[name])} differing (token, head) rows ({time.time() - t0:.1f}s)", flush=True)
        for f in res[name][:12]:
            print("  ", json.dumps(f), flush=True)
        if a.out:
            with open(a.out, "w") as fh:
                json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
