import json

import pytest

from isoexec.contract import decode, encode
from isoexec.errors import ContractDecodeError


def test_canonical_round_trip_is_byte_stable(dense_isoexec_cpu):
    b = encode(dense_isoexec_cpu)
    assert encode(decode(b)) == b
    assert encode(decode(encode(decode(b)))) == b


def test_canonical_bytes_are_sorted_compact_utf8(dense_isoexec_cpu):
    b = encode(dense_isoexec_cpu)
    obj = json.loads(b)
    assert b == json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert b" " not in b.replace(b'" "', b"")


def test_reordered_json_encodes_to_same_bytes(dense_isoexec_cpu):
    obj = json.loads(encode(dense_isoexec_cpu))
    obj["composition"].reverse()
    obj["cases"].reverse()
    for e in obj["composition"]:
        e["cases"].reverse()
        e["region"].reverse()
    obj["claims"]["tolerances"].reverse()
    obj["claims"]["topology"].reverse()
    pretty = json.dumps(obj, indent=3)
    assert encode(decode(pretty)) == encode(dense_isoexec_cpu)


def _mutated(contract, fn):
    obj = json.loads(encode(contract))
    fn(obj)
    return json.dumps(obj)


@pytest.mark.parametrize("mutate, path, words", [
    (lambda o: o.update(extra=1), "$.extra", "unknown field"),
    (lambda o: o.pop("claims"), "$.claims", "missing field"),
    (lambda o: o["composition"][0].update(bogus=True), "$.composition[0].bogus", "unknown field"),
    (lambda o: o["composition"][0].pop("half"), "$.composition[0].half", "missing field"),
    (lambda o: o["composition"][0]["impl"].pop("arch"), "$.composition[0].impl.arch", "missing field"),
    (lambda o: o.update(schema_version="2"), "$.schema_version", "unsupported schema_version"),
    (lambda o: o["cases"][0].update(grad="yes"), "$.cases[0].grad", "true or false"),
    (lambda o: o["cases"][0].update(role="judge"), "$.cases[0].role", "is not one of"),
    (lambda o: o["claims"]["topology"][0].update(domain=[True]), "$.claims.topology[0].domain[0]", "integer"),
    (lambda o: o["identities"].update(semantic="abc"), "$.identities.semantic", "SHA-256"),
    (lambda o: o["claims"]["tolerances"][0]["bounds"].update(max_abs="zero"),
     "$.claims.tolerances[0].bounds.max_abs", "decimal"),
    (lambda o: o["composition"][0]["constants"].update(X=[1]), "$.composition[0].constants.X", "integer, string"),
    (lambda o: o["composition"][0]["constants"].update(X="f32:0x3f80"), "$.composition[0].constants.X",
     "hex digits"),
    (lambda o: o["composition"][0].update(region=[]), "$.composition[0].region", "at least one"),
])
def test_strict_decode_names_the_json_path(dense_isoexec_cpu, mutate, path, words):
    with pytest.raises(ContractDecodeError) as ei:
        decode(_mutated(dense_isoexec_cpu, mutate))
    assert ei.value.path == path
    assert words in str(ei.value)


def test_raw_float_is_refused(dense_isoexec_cpu):
    text = _mutated(dense_isoexec_cpu, lambda o: o["composition"][0]["constants"].update(EPS="__F__"))
    text = text.replace('"__F__"', "1e-06")
    with pytest.raises(ContractDecodeError, match="raw JSON float"):
        decode(text)


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_refused(dense_isoexec_cpu, token):
    text = _mutated(dense_isoexec_cpu, lambda o: o["composition"][0]["constants"].update(EPS="__F__"))
    with pytest.raises(ContractDecodeError, match="not allowed"):
        decode(text.replace('"__F__"', token))


def test_duplicate_keys_are_refused(dense_isoexec_cpu):
    text = encode(dense_isoexec_cpu).decode()
    text = text.replace('"schema_version":"1"', '"schema_version":"1","schema_version":"1"')
    with pytest.raises(ContractDecodeError, match="duplicate key"):
        decode(text)


def test_float_bit_pattern_constant_round_trips(dense_isoexec_cpu):
    text = _mutated(dense_isoexec_cpu, lambda o: o["composition"][0]["constants"].update(EPS="f32:0x358637bd"))
    c = decode(text)
    assert dict(c.composition[0].constants)["EPS"] == "f32:0x358637bd" or any(
        dict(e.constants).get("EPS") == "f32:0x358637bd" for e in c.composition)
