"""How many examples a property test draws: fewer in the fast inner loop (``scripts/test --fast``).

The full run (the README's test command, CI) draws the numbers written in the tests.
"""

from __future__ import annotations

import os

#: Set by ``scripts/test --fast``.
FAST = os.environ.get("TRAINTRACE_FAST_TESTS") == "1"


def examples(full: int) -> int:
    """``full`` examples in the full run; a fifth (at least 10) in the fast loop."""
    return max(10, full // 5) if FAST else full
