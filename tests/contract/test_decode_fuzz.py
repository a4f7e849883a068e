"""Fuzzing the decoder: malformed input never crashes with anything but a clear ContractDecodeError."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from isoexec.contract import decode, encode
from isoexec.errors import ContractDecodeError

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_give_a_decode_error(data):
    try:
        decode(data)
    except ContractDecodeError as exc:
        assert exc.path.startswith("$")
    else:  # pragma: no cover - random bytes are never a valid contract
        raise AssertionError("random bytes decoded")


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_random_json_gives_a_decode_error(value):
    try:
        text = json.dumps(value)
    except ValueError:
        return
    try:
        decode(text)
    except ContractDecodeError as exc:
        assert exc.path.startswith("$") and str(exc)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_valid_contract_decodes_or_fails_cleanly(dense_isoexec_cpu, data):
    obj = json.loads(encode(dense_isoexec_cpu))
    # pick a random path into the object and replace the value there with random JSON
    node, key = obj, None
    for _ in range(data.draw(st.integers(1, 5))):
        if isinstance(node, dict) and node:
            key = data.draw(st.sampled_from(sorted(node)))
        elif isinstance(node, list) and node:
            key = data.draw(st.integers(0, len(node) - 1))
        else:
            break
        if not isinstance(node[key], (dict, list)):
            break
        node = node[key]
    try:
        if isinstance(node, dict) and node:
            k = data.draw(st.sampled_from(sorted(node)))
            node[k] = data.draw(json_values)
        elif isinstance(node, list) and node:
            node[data.draw(st.integers(0, len(node) - 1))] = data.draw(json_values)
        text = json.dumps(obj)
    except ValueError:
        return
    try:
        decode(text)
    except ContractDecodeError as exc:
        assert exc.path.startswith("$")
