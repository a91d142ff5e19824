"""traintrace.cli._engine and the report's JSON embedding: parsers and escapes, property-tested."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from traintrace.cli._engine import check_tail, compress_ranks, discover, parse_ranks

pytest.importorskip("duckdb")

from traintrace.cli._report import _safe_json


@given(st.sets(st.integers(min_value=0, max_value=5000), max_size=200))
def test_rank_lists_round_trip(ranks: set[int]) -> None:
    """compress_ranks writes what parse_ranks reads back, for any set of ranks."""
    assert parse_ranks(compress_ranks(sorted(ranks))) == sorted(ranks)


def test_rank_list_examples() -> None:
    """Ranges and singles, in the form the commands print."""
    assert compress_ranks([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert parse_ranks("0-2, 5") == [0, 1, 2, 5]
    with pytest.raises(ValueError):
        parse_ranks("x-y")


@given(st.text())
def test_embedded_json_never_closes_the_script_block(text: str) -> None:
    """Any record text embedded in the report stays inside its <script type=application/json> block."""
    embedded = _safe_json({"name": text, "message": text})
    assert "<" not in embedded and ">" not in embedded and "&" not in embedded
    assert "\u2028" not in embedded and "\u2029" not in embedded
    assert json.loads(embedded) == {"name": text, "message": text}


def test_discover_and_tail_check(tmp_path: Path) -> None:
    """Folders are searched recursively; a cut last line is detected without reading the whole file."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    good = tmp_path / "a" / "rank0.jsonl"
    good.write_text('{"kind":"header"}\n')
    cut = tmp_path / "a" / "b" / "rank1.jsonl"
    cut.write_text('{"kind":"header"}\n{"kind":"sp')
    (tmp_path / "a" / "notes.txt").write_text("x")
    assert sorted(p.name for p in discover([tmp_path])) == ["rank0.jsonl", "rank1.jsonl"]
    assert not check_tail(good).truncated_last_line
    assert check_tail(cut).truncated_last_line
