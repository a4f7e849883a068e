"""check_schema with a schema that refers to another file: the $ref resolves next to the schema's own
file, and the referred part keeps yamlio's stricter types (2.0 is not an integer, NaN not a number),
which jsonschema would drop for the referred file's own "$schema" dialect."""

import pytest
import yaml

from isoexec.errors import ConfigError
from isoexec.yamlio import check_schema

DIALECT = "https://json-schema.org/draft/2020-12/schema"


@pytest.fixture
def schemas(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "part.yaml").write_text(yaml.safe_dump(
        {"$schema": DIALECT, "type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"}}}))
    main = {"$schema": DIALECT, "type": "object", "properties": {"part": {"$ref": "sub/part.yaml"}}}
    path = tmp_path / "main.yaml"
    path.write_text(yaml.safe_dump(main))
    return main, path


def test_a_ref_to_another_file_resolves_next_to_the_schema(schemas):
    main, path = schemas
    check_schema({"part": {"n": 2, "x": 0.5}}, main, "cfg", path)
    with pytest.raises(ConfigError, match=r"cfg: \$\.part\.n: 'two' is not of type 'integer'"):
        check_schema({"part": {"n": "two"}}, main, "cfg", path)


@pytest.mark.parametrize("value,key", [(2.0, "n"), (float("nan"), "x")])
def test_the_referred_file_keeps_the_stricter_types(schemas, value, key):
    main, path = schemas
    with pytest.raises(ConfigError, match=rf"\$\.part\.{key}: nan|\$\.part\.{key}: 2\.0"):
        check_schema({"part": {key: value}}, main, "cfg", path)
