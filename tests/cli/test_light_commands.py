"""The commands that only read JSON start without torch or transformers (isoexec/cli.py, "Start-up").

CI starts the CLI many times (the main job runs `contract show` and `contract verify` eight times
each); importing torch costs about 1.8 s of CPU per start. One child process runs each light
command through ``isoexec.cli.main`` in turn and records, after each, its exit code and whether
torch or transformers had been imported.
"""

import json
import subprocess
import sys

from isoexec.contract import encode
from isoexec.gates.artifacts import write_artifact

CHILD = """
import json, sys
from isoexec.cli import main

seen = [{"argv": ["(import isoexec.cli)"], "rc": 0, "torch": "torch" in sys.modules,
         "transformers": "transformers" in sys.modules}]
for argv in json.loads(sys.argv[1]):
    try:
        rc = main(argv)
    except SystemExit as exc:   # --help: argparse exits
        rc = exc.code
    seen.append({"argv": argv, "rc": rc, "torch": "torch" in sys.modules,
                 "transformers": "transformers" in sys.modules})
print("SEEN " + json.dumps(seen))
"""


def _artifact_for(entry) -> dict:
    """A passing batch_invariance artifact for ``entry``: gives verify an artifact to parse and match."""
    return {"gate": {"family": "batch_invariance", "region": list(entry.region),
                     "impl": {"id": entry.impl.id, "version": entry.impl.version, "arch": entry.impl.arch},
                     "constants": dict(entry.constants), "shapes": {}, "dtype": "float32", "seed": 0,
                     "hazards": []},
            "verdict": "pass", "expect": "invariant", "compared": 1, "differing": 0,
            "env": {"date": "2025-01-01T00:00:00Z"}}


def test_contract_show_verify_diff_and_data_synthetic_start_without_torch(tmp_path, dense_isoexec_cpu,
                                                                          dense_native_cpu):
    iso, nat = tmp_path / "isoexec.json", tmp_path / "native.json"
    iso.write_bytes(encode(dense_isoexec_cpu))
    nat.write_bytes(encode(dense_native_cpu))
    gates = tmp_path / "gates"
    gates.mkdir()
    write_artifact(gates, _artifact_for(next(e for e in dense_isoexec_cpu.composition if e.discharge)))
    commands = {
        ("--help",): 0,
        ("contract", "show", str(iso), "--json"): 0,
        ("contract", "show", str(nat)): 0,
        ("contract", "show", str(tmp_path / "missing.json")): 2,
        # the draft's gate discharges are pending: verify matches them against the artifacts
        ("contract", "verify", str(iso), "--gates", str(gates), "--json"): 1,
        ("contract", "verify", str(iso)): 1,
        ("contract", "diff", str(iso), str(nat)): 1,
        ("contract", "diff", str(iso), str(iso), "--json"): 0,
        ("data", "synthetic", "--params", '{"n": 8}', "--seed", "0", "--out", str(tmp_path / "s.parquet")): 0,
    }
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps([list(c) for c in commands])],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.rsplit("SEEN ", 1)[1])
    assert [tuple(s["argv"]) for s in seen[1:]] == list(commands)
    assert [s["rc"] for s in seen[1:]] == list(commands.values()), r.stderr
    heavy = [(" ".join(s["argv"][:2]), [m for m in ("torch", "transformers") if s[m]]) for s in seen
             if s["torch"] or s["transformers"]]
    assert not heavy, f"loaded after (the first is the culprit): {heavy}"
    assert (tmp_path / "s.parquet").is_file()
