"""The native encoder's float formatter (``traintrace._encode.float_text``) against repr and orjson.

encode.c writes a float's shortest digits with a 64-bit power of ten and an error bound, and asks
PyOS_double_to_string where the bound cannot prove the answer. Every value here is compared on
both ways (``fast=False`` forces the fallback) and in both styles: json's (repr) and orjson's.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._examples import examples

native = pytest.importorskip("traintrace._encode")
#: The extension's float formatting itself, called directly: the same in either pass.
pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parent.parent

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is a test dependency
    orjson = None


def orjson_text(x: float) -> bytes:
    if orjson is None:
        pytest.skip("orjson is not installed")
    text: bytes = orjson.dumps(x)
    return text


def check(x: float) -> bool:
    """Both styles, fast and forced fallback, equal the serialisers'; True where the fast path answered."""
    expected = repr(x).encode()
    assert json.dumps(x).encode() == expected
    assert native.float_text(x, 0) == expected, x
    assert native.float_text(x, 0, False) == expected, x
    styled = orjson_text(x)
    assert native.float_text(x, 1) == styled, x
    assert native.float_text(x, 1, False) == styled, x
    fast = native.float_fast(x)
    assert fast is None or fast == repr(x), x
    return fast is not None


def from_bits(bits: int) -> float:
    value: float = struct.unpack("<d", struct.pack("<Q", bits))[0]
    return value


def test_powers_table_is_exact() -> None:
    """float_powers.h is what the generator computes with exact fractions."""
    spec = importlib.util.spec_from_file_location("gen_float_powers", ROOT / "scripts" / "gen_float_powers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_float_powers"] = module
    try:
        spec.loader.exec_module(module)
        assert (ROOT / "src" / "native" / "float_powers.h").read_text() == module.render()
    finally:
        del sys.modules["gen_float_powers"]


@settings(max_examples=examples(1000), deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=20, max_size=20))
def test_any_finite_float(values: list[float]) -> None:
    """20,000 floats as hypothesis draws them (its nasty values among them), twenty an example: one an example
    spent 19 s of CPU, most of it in hypothesis's own work for each example."""
    for x in values:
        check(x)


def test_random_bit_patterns() -> None:
    """300,000 random doubles (all exponents alike); the fallback is rare but taken."""
    rnd = random.Random(12)
    fast = slow = 0
    while fast + slow < 300_000:
        x = from_bits(rnd.getrandbits(64))
        if not math.isfinite(x):
            continue
        if check(x):
            fast += 1
        else:
            slow += 1
    assert 0 < slow < 0.02 * fast


def special_values() -> list[float]:
    values: list[float] = [0.0, -0.0, 5e-324, -5e-324, 1.7976931348623157e308, -1.7976931348623157e308]
    values += [2.2250738585072014e-308, 2.225073858507201e-308, math.ulp(0.0) * 3, 1e-323, 4.9406564584124654e-324]
    values += [1 / k for k in range(1, 3001)]
    values += [k / 10**j for k in range(1, 200) for j in range(0, 25)]
    values += [2.0**e for e in range(-1074, 1024)]
    values += [-(2.0**e) * 3 for e in range(-1074, 1022)]
    for k in range(-324, 309):
        try:
            ten = float(f"1e{k}")
        except OverflowError:  # pragma: no cover - float() does not raise for these
            continue
        if ten == 0.0 or math.isinf(ten):
            continue
        below, above = ten, ten
        for _ in range(3):
            below, above = math.nextafter(below, 0.0), math.nextafter(above, math.inf)
            values += [below, above]
        values += [ten, ten * 9.999999999999999, ten * 0.5, ten * 5]
    values += [float(i) for i in range(0, 20000)]
    values += [float(2**53 - i) for i in range(100)] + [float(2**53 + 2 * i) for i in range(100)]
    values += [float(2**e + d) for e in range(53, 80) for d in (-(2 ** (e - 52)), 2 ** (e - 52), 10**15)]
    values += [float(10**k) for k in range(0, 40)] + [float(10**k - 1) for k in range(0, 40)]
    values += [1.5e-5, 1e-7, 1e15, 1e16, 9.5e15, 0.3, 2 / 3, 1e23, 8.41e21, 5.0e-310]
    return [v for v in values if math.isfinite(v)]


def test_special_values() -> None:
    fast = slow = 0
    for x in special_values():
        for y in (x, -x):
            if check(y):
                fast += 1
            else:
                slow += 1
    assert fast > 0 and slow > 0


def test_loss_like_values_mostly_take_the_fast_path() -> None:
    """Losses such as 1/(i+1): the fast path answers nearly all (the fallback is rare, not absent)."""
    answered = sum(native.float_fast(1.0 / (i + 1)) is not None for i in range(100_000))
    assert answered > 99_000


def test_non_finite_is_refused() -> None:
    for bad in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError):
            native.float_text(bad, 0)
        with pytest.raises(ValueError):
            native.float_fast(bad)


def test_fast_text_is_a_round_trip_when_given() -> None:
    """A second, independent property: any fast text reads back as the same double."""
    rnd = random.Random(5)
    for _ in range(20_000):
        x = from_bits(rnd.getrandbits(64))
        if math.isfinite(x):
            text: Any = native.float_fast(x)
            if text is not None:
                assert float(text) == x and (math.copysign(1.0, float(text)) == math.copysign(1.0, x))
