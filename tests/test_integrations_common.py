"""What the integrations share: the batch size and tokens read from a batch's shapes."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from traintrace.integrations._common import batch_info  # noqa: E402


class Shaped:
    """An array-like that is not a tensor: only ``shape`` is read."""

    def __init__(self, *shape: Any) -> None:
        self.shape = shape


Pair = namedtuple("Pair", "inputs targets")


@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        ([torch.zeros(8, 3), torch.zeros(8)], (8, None)),
        ((torch.zeros(5, 2), torch.zeros(5)), (5, None)),
        # a first item without a size (a 0-d tensor, a string) gives way to the next one
        ([torch.tensor(1.0), torch.zeros(6, 2)], (6, None)),
        (("name", torch.zeros(4)), (4, None)),
        # a first item whose shape cannot be read as a size
        ([Shaped("x"), torch.zeros(3)], (3, None)),
        ([Shaped(), Shaped(7)], (7, None)),
        ([{"input_ids": torch.zeros(2, 10, dtype=torch.long)}], (2, 20)),
        ({"input_ids": torch.zeros(3, 4, dtype=torch.long), "labels": torch.zeros(3, 4)}, (3, 12)),
        ({"pixels": torch.zeros(9, 3)}, (9, None)),
        (torch.zeros(11, 2), (11, None)),
        (Pair(torch.zeros(12, 1), torch.zeros(12)), (12, None)),
        ([], (None, None)),
        ((), (None, None)),
        (["a", "b"], (None, None)),
        (None, (None, None)),
        (42, (None, None)),
    ],
)
def test_batch_info_reads_sizes_from_shapes(batch: Any, expected: tuple[int | None, int | None]) -> None:
    assert batch_info(batch) == expected


def test_batch_info_only_reads_the_first_four_items() -> None:
    batch = ["a", "b", "c", "d", torch.zeros(5)]
    assert batch_info(batch) == (None, None)
