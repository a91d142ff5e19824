"""Metric values: anything in, bounded JSON-safe data out."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._examples import examples
from traintrace._sanitize import MAX_ITEMS, MAX_STRING, convert_mapping, to_jsonable

json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=50)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.text(max_size=10) | st.integers(), children, max_size=5)
        | st.frozensets(st.integers(), max_size=5)
        | st.tuples(children, children)
    ),
    max_leaves=30,
)


@settings(max_examples=examples(300))
@given(st.dictionaries(st.text(max_size=30), json_like, max_size=10))
def test_any_mapping_becomes_strict_json(value: dict[Any, Any]) -> None:
    """The result always serialises with allow_nan=False and keys are strings."""
    converted = convert_mapping(value)
    text = json.dumps(converted, allow_nan=False)
    assert all(isinstance(k, str) for k in json.loads(text))


def test_non_finite_floats() -> None:
    """NaN and infinities become strings."""
    assert to_jsonable(math.nan) == "NaN"
    assert to_jsonable(-math.inf) == "-Infinity"


def test_numpy_and_torch_scalars() -> None:
    """numpy scalars and 0-d tensors become Python numbers; arrays become lists."""
    import numpy as np
    import torch

    assert to_jsonable(np.float32(0.5)) == 0.5
    assert to_jsonable(np.int64(3)) == 3
    assert to_jsonable(torch.tensor(2.5)) == 2.5
    assert to_jsonable(torch.tensor([1, 2])) == [1, 2]
    assert to_jsonable(np.array([[1, 2], [3, 4]])) == [[1, 2], [3, 4]]


def test_limits() -> None:
    """Strings, containers, depth and total size are bounded."""
    assert len(to_jsonable("x" * (MAX_STRING * 3))) < MAX_STRING + 40
    assert len(to_jsonable(list(range(MAX_ITEMS * 4)))) == MAX_ITEMS
    deep: list[Any] = []
    node = deep
    for _ in range(100):
        child: list[Any] = []
        node.append(child)
        node = child
    text = json.dumps(to_jsonable(deep))
    assert "too deep" in text
    wide = [[list(range(200)) for _ in range(200)] for _ in range(10)]
    assert json.dumps(to_jsonable(wide)).count("truncated") > 0


def test_cycles_end() -> None:
    """A self-referencing structure converts without recursion errors."""
    cyclic: dict[str, Any] = {}
    cyclic["me"] = cyclic
    json.dumps(to_jsonable(cyclic))


def test_objects_that_break_repr() -> None:
    """An object whose __repr__ raises is described, not propagated."""

    class Bad:
        def __repr__(self) -> str:
            raise RuntimeError("no")

    assert to_jsonable(Bad()) == "<unrepresentable Bad>"


def test_huge_arrays_are_cut_before_they_are_converted() -> None:
    """A 10-million-element numpy array and torch tensor (views that take no memory) become at
    most 256 items, and converting them allocates a few kilobytes, not the hundreds of
    megabytes a full ``tolist()`` would (issue 17, item 7)."""
    import tracemalloc

    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    values = {
        "np1": np.broadcast_to(np.float64(1.5), (10_000_000,)),
        "np2": np.broadcast_to(np.int64(2), (5_000, 2_000)),
        "t1": torch.zeros(1).expand(10_000_000),
    }
    tracemalloc.start()
    try:
        converted = {key: to_jsonable(value) for key, value in values.items()}
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5_000_000
    assert converted["np1"] == [1.5] * MAX_ITEMS
    assert converted["t1"] == [0.0] * MAX_ITEMS
    rows = converted["np2"]
    assert 1 <= len(rows) <= MAX_ITEMS and all(row and set(row) == {2} for row in rows)
