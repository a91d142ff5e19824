"""Redaction of secret-looking metric and attribute keys, on the writer thread.

A key is redacted when its words end with the words of a pattern: with the
pattern ``token``, ``hf_token``, ``authToken`` and ``token`` are redacted and
``tokens``, ``tokens_per_second`` and ``token_count`` are not. Words are
split at ``_``, ``-``, ``.``, spaces and camelCase humps, case-insensitively.
The value is replaced by ``"<redacted>"``; nested mappings are searched too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Final

REDACTED: Final = "<redacted>"

#: The default ``Config.redact_keys``.
DEFAULT_REDACT_KEYS: Final = (
    "password",
    "passwd",
    "secret",
    "token",
    "api_key",
    "apikey",
    "access_key",
    "private_key",
    "secret_key",
    "credential",
    "credentials",
    "authorization",
    "cookie",
)

_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
_CACHE_LIMIT = 4096


def words(key: str) -> tuple[str, ...]:
    """The lower-case words of a key (``hfToken`` -> ``('hf', 'token')``)."""
    return tuple(w.lower() for w in _WORDS.findall(key))


class Redactor:
    """Decides, with a bounded cache, which keys are secret."""

    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns = tuple(p for p in (words(str(p)) for p in patterns) if p)
        self._cache: dict[str, bool] = {}

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def secret(self, key: str) -> bool:
        known = self._cache.get(key)
        if known is not None:
            return known
        parts = words(key)
        found = any(len(parts) >= len(p) and parts[-len(p) :] == p for p in self.patterns)
        if len(self._cache) < _CACHE_LIMIT:
            self._cache[key] = found
        return found

    def apply(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """``attrs`` (JSON-safe, string keys) with secret values replaced; copies only if needed."""
        out: dict[str, Any] | None = None
        for key, value in attrs.items():
            if self.secret(key):
                replacement: Any = REDACTED
            elif type(value) is dict:
                replacement = self.apply(value)
                if replacement is value:
                    continue
            elif type(value) is list and any(type(v) is dict for v in value):
                replacement = [self.apply(v) if type(v) is dict else v for v in value]
            else:
                continue
            if out is None:
                out = dict(attrs)
            out[key] = replacement
        return attrs if out is None else out
