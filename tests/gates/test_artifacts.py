import json

import pytest

from isoexec.errors import IsoExecError
from isoexec.gates.artifacts import artifact_id, load_artifacts, write_artifact


def _body(verdict="pass"):
    return {"gate": {"family": "batch_invariance", "region": ["lm_head"],
                     "impl": {"id": "gemm_fixed_k", "version": "1", "arch": "cpu"}, "constants": {"BLOCK_K": 64},
                     "shapes": {"K": 64}, "dtype": "float32", "seed": 0, "hazards": []},
            "expect": "invariant", "verdict": verdict, "counts": {"compared": 4, "differing": 0},
            "env": {"date": "2026-01-01T00:00:00Z"}}


def test_artifact_id_is_content_hash_and_file_name(tmp_path):
    gid, path = write_artifact(tmp_path, _body())
    assert path.name == f"{gid}.json"
    assert artifact_id(json.loads(path.read_text())) == gid
    gid2, _ = write_artifact(tmp_path, _body("fail"))
    assert gid2 != gid
    assert set(load_artifacts(tmp_path)) == {gid, gid2}


def test_edited_artifact_is_refused(tmp_path):
    gid, path = write_artifact(tmp_path, _body("fail"))
    path.write_text(path.read_text().replace('"fail"', '"pass"'))
    with pytest.raises(IsoExecError, match="does not hash to its id"):
        load_artifacts(tmp_path)


def test_missing_gates_dir_is_a_clear_error(tmp_path):
    with pytest.raises(IsoExecError, match="run `isoexec gates run"):
        load_artifacts(tmp_path / "nope")
