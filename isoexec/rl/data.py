"""RL prompts: the DAPO-Math-17k parquet, a synthetic stand-in in the same schema, and a
resumable prompt stream.

The published DAPO-Math-17k file is a verl RL parquet. One row is::

    data_source   str                      "math_dapo"
    prompt        list[{content, role}]    one user message: instruction + problem
    ability       str                      "MATH"
    reward_model  {ground_truth, style}    e.g. {"ground_truth": "34", "style": "rule-lighteval/MATH_v2"}
    extra_info    {index}                  a per-row id string

Only ``prompt`` and ``reward_model`` are needed to train; the other three are kept when we write
a file so that our synthetic set is interchangeable with the real one (and with verl's loaders).
The published file repeats its 17,917 distinct prompts about 100 times, so :func:`load_problems`
de-duplicates by prompt text: without that an "epoch" would be 100 epochs and one batch could
hold the same problem many times, which silently breaks group statistics.

No dataset hub is reachable on our machines, so tests and the CPU workflow use
:func:`synthetic_arithmetic` written with :func:`write_parquet`; the real file is read by the same
:func:`load_problems`.

:class:`PromptStream` hands out prompts in an order fixed by ``(seed, epoch)`` and can be stopped
and resumed at any prompt: RL checkpoints store its position, and DAPO's dynamic sampling asks it
for "the next k prompts" to refill a batch after zero-variance groups were dropped.
"""

from __future__ import annotations

import hashlib
import os
import random
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from ..errors import IsoExecError
from ..paths import atomic_writer

#: Columns of a verl RL parquet, in the published order. The first two are required to read.
DAPO_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
REQUIRED_COLUMNS = ("prompt", "reward_model")

#: The reward style string the published set carries (a rule-based, lighteval-MATH-style check).
DAPO_REWARD_STYLE = "rule-lighteval/MATH_v2"

#: The instruction that wraps every problem in the published set. The reward reads the LAST
#: "Answer:" line of a response, so a prompt must ask for exactly that; synthetic problems use
#: the same wrapper so a model sees one format whatever the data source.
DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
    "\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


class DatasetNotFound(IsoExecError, FileNotFoundError):
    """The prompt file named by the config does not exist."""


class DataSchemaError(IsoExecError, ValueError):
    """The prompt file exists but is not a verl RL parquet (a column or field is missing)."""


@dataclass(frozen=True)
class Problem:
    """One distinct prompt. ``prompt_text`` is the user message as stored (instruction included);
    ``ground_truth`` is the string the verifier compares the last "Answer:" line with."""

    id: str
    prompt_text: str
    ground_truth: str


# --------------------------------------------------------------------------- reading


def _read_table(path: Path, columns: Sequence[str]):
    """The parquet's columns as one pyarrow table.

    Read through the ``datasets`` library (the verl/DAPO tooling's reader) when it is installed.
    It is not installable on the reference GPU host (docs/gpu_notes.md), so there we fall back to
    pyarrow, which reads the same file into the same table. ``keep_in_memory`` and a throw-away
    cache folder keep ``datasets`` from leaving arrow copies in the user's home.
    """
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        bars_were_on = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # a library call should not draw progress bars
        try:
            with tempfile.TemporaryDirectory(prefix="isoexec-ds-") as cache:
                ds = datasets.load_dataset(
                    "parquet", data_files=str(path), split="train", columns=list(columns),
                    keep_in_memory=True, cache_dir=cache,
                )
                return ds.data.table
        finally:
            if bars_were_on:
                datasets.enable_progress_bars()
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - depends on the host
        raise ImportError("reading prompts needs `datasets` or `pyarrow`: pip install 'isoexec[rl]'") from e
    return pq.read_table(path, columns=list(columns))


def _check_schema(path: Path) -> list[str]:
    """Names of the file's columns, or a :class:`DataSchemaError` naming what is missing.

    Only the parquet footer is read, so a wrong file is refused before any data is loaded.
    """
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends for a non-parquet file
        raise DataSchemaError(f"{path}: not a readable parquet file ({e})") from e
    names = list(schema.names)
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise DataSchemaError(
            f"{path}: missing column(s) {', '.join(repr(c) for c in missing)}; a verl RL parquet "
            f"has {', '.join(DAPO_COLUMNS)} (found: {', '.join(names) or 'none'})")
    return names


def _user_text(messages: Any, where: str) -> str:
    """The content of the last user message of a ``prompt`` cell (DAPO has exactly one)."""
    if not isinstance(messages, list) or not messages:
        raise DataSchemaError(f"{where}: 'prompt' must be a non-empty list of {{role, content}} messages")
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            content = m.get("content")
            if not isinstance(content, str):
                raise DataSchemaError(f"{where}: the user message has no string 'content'")
            return content
    raise DataSchemaError(f"{where}: 'prompt' has no message with role 'user'")


def _ground_truth(cell: Any, where: str) -> str:
    if not isinstance(cell, dict) or cell.get("ground_truth") is None:
        raise DataSchemaError(f"{where}: 'reward_model' must be a struct with a 'ground_truth' field")
    return str(cell["ground_truth"])


def _row_id(extra: Any, text: str) -> str:
    """``extra_info.index`` when the file has one, else a digest of the prompt text (stable)."""
    if isinstance(extra, dict) and extra.get("index") is not None:
        return str(extra["index"])
    return "sha1:" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def load_problems(path: str | os.PathLike, limit: int | None = None) -> list[Problem]:
    """Distinct problems of a verl RL parquet, in order of first appearance.

    Rows whose user-message text was already seen are dropped (the first row's id and ground
    truth win; if a repeat carries a different ground truth a warning counts such prompts).
    ``limit`` caps the number of *distinct* problems returned, so ``limit=64`` means 64 different
    prompts even in the 100x-repeated published file.
    """
    path = Path(path)
    if limit is not None and limit < 0:
        raise ValueError(f"load_problems: limit must be >= 0, got {limit}")
    if not path.is_file():
        raise DatasetNotFound(
            f"prompt file {str(path)!r} not found; generate the synthetic set "
            f"(isoexec.rl.data.synthetic_arithmetic + write_parquet) or point the config at a "
            f"local copy of DAPO-Math-17k")
    names = _check_schema(path)
    columns = list(REQUIRED_COLUMNS) + (["extra_info"] if "extra_info" in names else [])
    table = _read_table(path, columns)

    def rows():
        for batch in table.to_batches(max_chunksize=65536):
            cols = {c: batch.column(c).to_pylist() for c in columns}
            extras = cols.get("extra_info", [None] * batch.num_rows)
            for messages, rm, extra in zip(cols["prompt"], cols["reward_model"], extras):
                yield {"prompt": messages, "reward_model": rm, "extra_info": extra}

    return problems_from_rows(rows(), limit=limit, source=str(path))


def problems_from_rows(rows: Iterable[Mapping[str, Any]], limit: int | None = None,
                       source: str = "rows") -> list[Problem]:
    """Distinct :class:`Problem` s of rows in the DAPO schema (dicts as :func:`dapo_row` makes and
    :func:`synthetic_arithmetic` returns), de-duplicated exactly as :func:`load_problems` does."""
    problems: list[Problem] = []
    seen: dict[str, str] = {}          # prompt text -> ground truth of its first row
    conflicts: set[str] = set()
    for n, row in enumerate(rows):
        where = f"{source}: row {n}"
        if not isinstance(row, Mapping) or any(c not in row for c in REQUIRED_COLUMNS):
            raise DataSchemaError(f"{where}: needs the columns {', '.join(REQUIRED_COLUMNS)}")
        text = _user_text(row["prompt"], where)
        truth = _ground_truth(row["reward_model"], where)
        first = seen.get(text)
        if first is not None:
            if first != truth:
                conflicts.add(text)
            continue
        if limit is not None and len(problems) >= limit:
            break
        seen[text] = truth
        problems.append(Problem(_row_id(row.get("extra_info"), text), text, truth))
    if conflicts:
        warnings.warn(f"{source}: {len(conflicts)} repeated prompt(s) carry different ground truths; "
                      f"the first row's ground truth is used", stacklevel=2)
    return problems


# --------------------------------------------------------------------------- writing


def dapo_row(prompt_text: str, ground_truth: str, index: str, data_source: str = "math_dapo") -> dict:
    """One row in the published schema (used by the synthetic set and by tests)."""
    return {
        "data_source": data_source,
        "prompt": [{"content": prompt_text, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": str(ground_truth), "style": DAPO_REWARD_STYLE},
        "extra_info": {"index": str(index)},
    }


def _arrow_schema():
    import pyarrow as pa

    return pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        ("extra_info", pa.struct([("index", pa.string())])),
    ])


def write_parquet(rows: Iterable[dict], path: str | os.PathLike) -> Path:
    """Write rows in the published schema to ``path``, atomically.

    The file is written next to its destination under a temporary name, synced, then renamed,
    so a workflow job killed mid-write never leaves a truncated parquet that a later job would
    take for a finished output. The schema is explicit (not inferred) so an empty or odd row set
    still yields the exact column types :func:`load_problems` and verl expect.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq


    path = Path(path)
    table = pa.Table.from_pylist(list(rows), schema=_arrow_schema())
    with atomic_writer(path) as f:
        pq.write_table(table, f)
    return path


# --------------------------------------------------------------------------- synthetic set


def synthetic_arithmetic(n: int, seed: int, *, min_terms: int = 2, max_terms: int = 3,
                         max_operand: int = 20, ops: str = "+-*",
                         data_source: str = "synthetic_arithmetic") -> list[dict]:
    """``n`` distinct short arithmetic problems (e.g. ``12+7*3``) as rows of the DAPO schema.

    Each prompt is the DAPO instruction around "Compute <expr>.", so the response format and the
    verifier are exactly those of the real set, while a tiny CPU model has a task it can learn.
    The ground truth is the integer value of the expression under the usual precedence
    (``*`` before ``+``/``-``, left to right), computed with integers (no float rounding).
    Deterministic in ``seed``; the expressions are distinct, and asking for more than can be
    drawn raises rather than looping forever.
    """
    if n < 0:
        raise ValueError(f"synthetic_arithmetic: n must be >= 0, got {n}")
    if not 1 <= min_terms <= max_terms:
        raise ValueError(f"synthetic_arithmetic: need 1 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
    if max_operand < 0 or not ops or set(ops) - set("+-*"):
        raise ValueError(f"synthetic_arithmetic: max_operand >= 0 and ops from '+-*' (got {max_operand}, {ops!r})")
    rng = random.Random(f"isoexec-synthetic:{seed}")
    rows: list[dict] = []
    seen: set[str] = set()
    budget = 100 * n + 1000
    while len(rows) < n:
        budget -= 1
        if budget < 0:
            raise ValueError(f"synthetic_arithmetic: could not draw {n} distinct expressions with "
                             f"terms {min_terms}..{max_terms}, operands 0..{max_operand}, ops {ops!r}")
        k = rng.randint(min_terms, max_terms)
        nums = [rng.randint(0, max_operand) for _ in range(k)]
        chosen = [rng.choice(ops) for _ in range(k - 1)]
        expr = str(nums[0]) + "".join(o + str(x) for o, x in zip(chosen, nums[1:]))
        if expr in seen:
            continue
        seen.add(expr)
        text = DAPO_INSTRUCTION.format(problem=f"Compute {expr}.")
        rows.append(dapo_row(text, str(evaluate_arithmetic(expr)), f"{data_source}-{seed}-{len(rows)}",
                             data_source=data_source))
    return rows


def evaluate_arithmetic(expr: str) -> int:
    """Integer value of ``a op b op c ...`` with ops ``+ - *`` and non-negative integer literals,
    ``*`` binding tighter. A tiny parser instead of ``eval`` so nothing is ever executed."""
    terms: list[int] = []    # additive terms, each already multiplied out
    signs: list[int] = []
    num, sign, prod = "", 1, None
    for ch in expr + "+":
        if ch.isdigit():
            num += ch
            continue
        if ch not in "+-*" or not num:
            raise ValueError(f"evaluate_arithmetic: cannot parse {expr!r} at {ch!r}")
        value = int(num) if prod is None else prod * int(num)
        num = ""
        if ch == "*":
            prod = value
            continue
        terms.append(value)
        signs.append(sign)
        prod = None
        sign = 1 if ch == "+" else -1
    return sum(s * t for s, t in zip(signs, terms))


# --------------------------------------------------------------------------- stream


def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """A permutation of range(n) that depends only on (seed, epoch, n).

    Each index is ranked by a BLAKE2b digest of (seed, epoch, index): unlike a shuffle driven by
    a library RNG, this order cannot change with a Python, numpy or torch release, so a run
    resumed on another machine (or re-run next year) sees the same prompts in the same steps.
    """
    def key(i: int) -> bytes:
        return hashlib.blake2b(f"{seed}:{epoch}:{i}".encode(), digest_size=16).digest()

    return sorted(range(n), key=key)


def _fingerprint(problems: Sequence[Problem]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in problems:
        h.update(p.id.encode("utf-8") + b"\0" + p.prompt_text.encode("utf-8") + b"\0")
    return h.hexdigest()


class PromptStream:
    """An endless, deterministic stream of problems: epoch 0 in its order, then epoch 1, ...

    The order of epoch ``e`` depends only on ``(seed, e)`` and the problem list. A batch may span
    an epoch boundary (the stream never drops the tail of an epoch), and :meth:`next_batch` takes
    any number of prompts, which is how DAPO's dynamic sampling refills a batch. The position
    (epoch, offset) is the whole state: :meth:`state_dict` / :meth:`load_state_dict` restore it,
    and a resumed stream yields exactly what the uninterrupted one would have.
    """

    def __init__(self, problems: Sequence[Problem], batch_size: int, seed: int):
        if not problems:
            raise ValueError("PromptStream: no problems")
        if batch_size < 1:
            raise ValueError(f"PromptStream: batch_size must be >= 1, got {batch_size}")
        self.problems = list(problems)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.offset = 0                 # prompts of the current epoch already handed out
        self._order = _epoch_order(len(self.problems), seed, 0)
        self._fingerprint = _fingerprint(self.problems)

    def next_batch(self, size: int | None = None) -> list[Problem]:
        """The next ``size`` problems (default ``batch_size``), crossing into the next epoch."""
        size = self.batch_size if size is None else size
        if size < 0:
            raise ValueError(f"PromptStream.next_batch: size must be >= 0, got {size}")
        out: list[Problem] = []
        while len(out) < size:
            if self.offset == len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = _epoch_order(len(self.problems), self.seed, self.epoch)
            take = min(size - len(out), len(self._order) - self.offset)
            out.extend(self.problems[i] for i in self._order[self.offset:self.offset + take])
            self.offset += take
        return out

    def __iter__(self) -> Iterator[list[Problem]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        """JSON-serialisable position; the fingerprint guards against resuming on other data."""
        return {"seed": self.seed, "epoch": self.epoch, "offset": self.offset,
                "num_problems": len(self.problems), "fingerprint": self._fingerprint}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("seed", self.seed), ("num_problems", len(self.problems)),
                          ("fingerprint", self._fingerprint)):
            if state.get(key) != mine:
                raise ValueError(f"PromptStream: cannot resume, checkpoint {key} {state.get(key)!r} "
                                 f"differs from this stream's {mine!r} (different data or seed)")
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset <= len(self.problems):
            raise ValueError(f"PromptStream: bad position epoch={epoch} offset={offset}")
        self.epoch, self.offset = epoch, offset
        self._order = _epoch_order(len(self.problems), self.seed, epoch)
