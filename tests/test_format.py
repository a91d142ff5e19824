"""The record format's one description (``_format.FIELDS``) agrees with the JSON Schema and the docs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from traintrace import _format
from traintrace.cli import _engine

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "src" / "traintrace" / "schema" / "record-v1.schema.json").read_text())

#: Header fields of a launcher agent's stream, which the schema leaves open: ``role`` is what
#: ``traintrace-run`` writes; the command also accepts ``source`` as the agent's marker.
PASSTHROUGH = {"source", "role"}

#: JSON Schema types a DuckDB column type stands for.
_JSON_TYPES = {"BIGINT": {"integer"}, "VARCHAR": {"string"}, "JSON": {"object"}, "DOUBLE": {"number", "integer"}}


def _schema_properties(node: Any, out: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Every property the schema declares, with each place's declaration."""
    if isinstance(node, dict):
        for name, spec in (node.get("properties") or {}).items():
            out.setdefault(name, []).append(spec)
        for value in node.values():
            _schema_properties(value, out)
    elif isinstance(node, list):
        for value in node:
            _schema_properties(value, out)
    return out


def _types(spec: dict[str, Any]) -> set[str]:
    if "$ref" in spec:
        return {SCHEMA["$defs"][spec["$ref"].rsplit("/", 1)[-1]].get("type", "object")}
    if "const" in spec:
        return {"integer" if isinstance(spec["const"], int) else "string"}
    if "enum" in spec:
        return {"string"}
    kind = spec.get("type", [])
    return {kind} if isinstance(kind, str) else set(kind)


def test_every_field_the_readers_use_is_in_the_schema_with_a_matching_type() -> None:
    declared = _schema_properties(SCHEMA, {})
    for name, field in _format.FIELDS.items():
        if name in PASSTHROUGH:
            continue
        assert name in declared, f"{name} is read by the command but the JSON Schema does not declare it"
        wanted = _JSON_TYPES[field.sql]
        for spec in declared[name]:
            assert _types(spec) - {"null"} <= wanted | {"null"}, f"{name}: schema says {spec}, FIELDS says {field.sql}"


def test_the_schema_version_is_the_one_the_writer_stamps() -> None:
    declared = _schema_properties(SCHEMA, {})
    assert {"const": _format.SCHEMA} in declared["schema"]
    assert {"const": _format.SCHEMA_VERSION} in declared["schema_version"]


def test_the_command_reads_the_columns_the_format_describes() -> None:
    assert dict(_engine.COLUMNS) == _format.SQL_COLUMNS


def test_docs_name_every_field() -> None:
    text = (ROOT / "docs" / "format.md").read_text()
    missing = [name for name in _format.FIELDS if f"`{name}`" not in text and name not in PASSTHROUGH - {"role"}]
    assert not missing, f"docs/format.md does not describe {missing}"
