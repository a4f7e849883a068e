"""DAPO parquet loading (dedup, schema errors), the synthetic set, atomic writing, PromptStream."""

from __future__ import annotations

import ast
import json
import operator
import sys
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings, strategies as st

from isoexec.rl.data import (DAPO_COLUMNS, DAPO_INSTRUCTION, DataSchemaError, DatasetNotFound,
                             Problem, PromptStream, dapo_row, evaluate_arithmetic, load_problems,
                             problems_from_rows, synthetic_arithmetic, write_parquet)
from isoexec.rl.reward import verify


def _repeated_rows():
    """Three distinct prompts, interleaved and repeated like the published file."""
    texts = [DAPO_INSTRUCTION.format(problem=f"Problem {k}?") for k in "ABC"]
    truths = ["34", "-3", "1007"]
    order = [0, 1, 0, 2, 1, 1, 0, 2, 2, 0]
    return [dapo_row(texts[k], truths[k], f"uuid-{i}") for i, k in enumerate(order)], texts, truths


def test_dedup_keeps_first_occurrence_in_order(tmp_path):
    rows, texts, truths = _repeated_rows()
    path = write_parquet(rows, tmp_path / "dapo.parquet")
    assert pq.read_schema(path).names == list(DAPO_COLUMNS)
    assert pq.read_table(path).num_rows == 10
    problems = load_problems(path)
    assert problems == [Problem("uuid-0", texts[0], "34"), Problem("uuid-1", texts[1], "-3"),
                        Problem("uuid-3", texts[2], "1007")]


def test_limit_counts_distinct_problems(tmp_path):
    rows, texts, _ = _repeated_rows()
    path = write_parquet(rows, tmp_path / "dapo.parquet")
    assert [p.prompt_text for p in load_problems(path, limit=2)] == texts[:2]
    assert load_problems(path, limit=0) == []


def test_rows_in_memory_dedup_like_the_file(tmp_path):
    rows, _, _ = _repeated_rows()
    assert problems_from_rows(rows) == load_problems(write_parquet(rows, tmp_path / "d.parquet"))
    syn = synthetic_arithmetic(10, seed=0)
    assert [p.id for p in problems_from_rows(syn)] == [r["extra_info"]["index"] for r in syn]
    with pytest.raises(DataSchemaError, match="row 0.*reward_model"):
        problems_from_rows([{"prompt": rows[0]["prompt"]}])


def test_pyarrow_fallback_reads_the_same(tmp_path, monkeypatch):
    rows, _, _ = _repeated_rows()
    path = write_parquet(rows, tmp_path / "dapo.parquet")
    with_datasets = load_problems(path)
    monkeypatch.setitem(sys.modules, "datasets", None)   # as on the GPU host: not installed
    assert load_problems(path) == with_datasets


def test_file_without_extra_info_gets_stable_ids(tmp_path):
    rows, _, _ = _repeated_rows()
    table = pa.Table.from_pylist([{k: r[k] for k in ("prompt", "reward_model")} for r in rows])
    pq.write_table(table, tmp_path / "bare.parquet")
    a = load_problems(tmp_path / "bare.parquet")
    assert len(a) == 3 and all(p.id.startswith("sha1:") for p in a)
    assert a == load_problems(tmp_path / "bare.parquet")


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(DatasetNotFound, match="nope.parquet"):
        load_problems(tmp_path / "nope.parquet")
    with pytest.raises(FileNotFoundError):
        load_problems(tmp_path / "nope.parquet")


@pytest.mark.parametrize("drop", ["prompt", "reward_model"])
def test_missing_column_is_named(tmp_path, drop):
    rows, _, _ = _repeated_rows()
    keep = [c for c in DAPO_COLUMNS if c != drop]
    pq.write_table(pa.Table.from_pylist([{k: r[k] for k in keep} for r in rows]), tmp_path / "x.parquet")
    with pytest.raises(DataSchemaError, match=f"missing column.*'{drop}'"):
        load_problems(tmp_path / "x.parquet")


def test_not_a_parquet(tmp_path):
    (tmp_path / "x.parquet").write_text("question,answer\n1+1,2\n")
    with pytest.raises(DataSchemaError, match="not a readable parquet"):
        load_problems(tmp_path / "x.parquet")


def test_prompt_without_user_message(tmp_path):
    row = dapo_row("hi", "1", "u0")
    row["prompt"] = [{"content": "be terse", "role": "system"}]
    write_parquet([row], tmp_path / "x.parquet")
    with pytest.raises(DataSchemaError, match="row 0.*role 'user'"):
        load_problems(tmp_path / "x.parquet")


def test_conflicting_repeat_warns_and_keeps_first(tmp_path):
    write_parquet([dapo_row("same", "1", "a"), dapo_row("same", "2", "b")], tmp_path / "x.parquet")
    with pytest.warns(UserWarning, match="1 repeated prompt"):
        problems = load_problems(tmp_path / "x.parquet")
    assert problems == [Problem("a", "same", "1")]


def test_write_parquet_is_atomic(tmp_path, monkeypatch):
    path = write_parquet([dapo_row("p", "1", "a")], tmp_path / "out.parquet")
    before = path.read_bytes()

    def killed_mid_write(table, where, **kw):
        where.write(b"PAR1 half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(pq, "write_table", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        write_parquet([dapo_row("q", "2", "b")], path)
    assert path.read_bytes() == before                      # the old file is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.parquet"]   # no temp file left
    with pytest.raises(Exception):
        write_parquet([{"prompt": "not a list of messages"}], path)
    assert path.read_bytes() == before


# --------------------------------------------------------------------------- synthetic set

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _reference_value(expr: str) -> int:
    """Python's own parse of the expression (precedence included), evaluated on the AST."""
    def ev(node):
        if isinstance(node, ast.BinOp):
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        assert isinstance(node, ast.Constant) and isinstance(node.value, int)
        return node.value
    return ev(ast.parse(expr, mode="eval").body)


def _expr(row) -> str:
    text = row["prompt"][0]["content"]
    return text.split("Compute ", 1)[1].split(".", 1)[0]


def test_synthetic_is_deterministic_and_distinct():
    a = synthetic_arithmetic(200, seed=7)
    assert a == synthetic_arithmetic(200, seed=7)
    assert a != synthetic_arithmetic(200, seed=8)
    assert len({_expr(r) for r in a}) == 200
    assert len({r["extra_info"]["index"] for r in a}) == 200


def test_synthetic_ground_truth_is_correct_and_verifiable(tmp_path):
    rows = synthetic_arithmetic(100, seed=1)
    problems = load_problems(write_parquet(rows, tmp_path / "syn.parquet"))
    assert len(problems) == 100
    for row, p in zip(rows, problems):
        assert p.prompt_text.startswith("Solve the following math problem step by step.")
        assert int(p.ground_truth) == _reference_value(_expr(row))
        assert verify(f"Let me compute.\nAnswer: {p.ground_truth}", p.ground_truth)[0]
        assert not verify(f"Answer: {int(p.ground_truth) + 1}", p.ground_truth)[0]


def test_synthetic_refuses_impossible_requests():
    with pytest.raises(ValueError, match="distinct"):
        synthetic_arithmetic(50, seed=0, min_terms=1, max_terms=1, max_operand=9)  # only 10 exist
    with pytest.raises(ValueError):
        synthetic_arithmetic(3, seed=0, ops="/")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 999), min_size=1, max_size=6), st.data())
def test_evaluate_arithmetic_matches_python(nums, data):
    ops = data.draw(st.lists(st.sampled_from("+-*"), min_size=len(nums) - 1, max_size=len(nums) - 1))
    expr = str(nums[0]) + "".join(o + str(x) for o, x in zip(ops, nums[1:]))
    assert evaluate_arithmetic(expr) == _reference_value(expr)


@pytest.mark.parametrize("bad", ["", "1+", "+1", "1**2", "1 + 2", "(1)"])
def test_evaluate_arithmetic_rejects_garbage(bad):
    with pytest.raises(ValueError):
        evaluate_arithmetic(bad)


# --------------------------------------------------------------------------- PromptStream


def _problems(n):
    return [Problem(f"id{i}", f"text {i}", str(i)) for i in range(n)]


def test_each_epoch_is_a_permutation_and_depends_on_seed_and_epoch():
    ps = _problems(11)
    s = PromptStream(ps, batch_size=11, seed=3)
    e0, e1 = s.next_batch(), s.next_batch()
    assert sorted(p.id for p in e0) == sorted(p.id for p in ps) == sorted(p.id for p in e1)
    assert e0 != e1                                  # a new order every epoch
    assert e0 != PromptStream(ps, 11, seed=4).next_batch()
    assert e0 == PromptStream(ps, 11, seed=3).next_batch()


def test_batches_cross_epoch_boundaries_without_dropping():
    s = PromptStream(_problems(5), batch_size=3, seed=0)
    seen = [p.id for _ in range(5) for p in s.next_batch()]   # 15 prompts = 3 epochs
    assert all(sorted(seen[i:i + 5]) == sorted(f"id{k}" for k in range(5)) for i in (0, 5, 10))
    assert s.state_dict()["epoch"] == 2 and s.state_dict()["offset"] == 5


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=12), st.integers(0, 12), st.integers(0, 2**32))
def test_resume_equals_uninterrupted(sizes, cut, seed):
    ps = _problems(7)
    cut = min(cut, len(sizes))
    straight = PromptStream(ps, batch_size=4, seed=seed)
    expected = [straight.next_batch(k) for k in sizes]

    first = PromptStream(ps, batch_size=4, seed=seed)
    got = [first.next_batch(k) for k in sizes[:cut]]
    state = json.loads(json.dumps(first.state_dict()))       # as a checkpoint stores it
    resumed = PromptStream(ps, batch_size=4, seed=seed)
    resumed.load_state_dict(state)
    got += [resumed.next_batch(k) for k in sizes[cut:]]
    assert got == expected


def test_resume_refuses_other_data_or_seed():
    s = PromptStream(_problems(6), 2, seed=1)
    s.next_batch()
    state = s.state_dict()
    with pytest.raises(ValueError, match="seed"):
        PromptStream(_problems(6), 2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_problems"):
        PromptStream(_problems(7), 2, seed=1).load_state_dict(state)
    other = _problems(6)
    other[0] = Problem("id0", "changed", "0")
    with pytest.raises(ValueError, match="fingerprint"):
        PromptStream(other, 2, seed=1).load_state_dict(state)


def test_stream_argument_errors():
    with pytest.raises(ValueError):
        PromptStream([], 2, 0)
    with pytest.raises(ValueError):
        PromptStream(_problems(2), 0, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert PromptStream(_problems(2), 2, 0).next_batch(0) == []
