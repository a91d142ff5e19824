"""Redaction of secret-looking metric and attribute keys, on the writer thread.

A key is secret when its words end with the words of a pattern, once trailing
numbers (``api_key_1``, ``token2``) and qualifiers that still name the secret
(``password_hash``, ``token_value``, ``auth_header``) are set
aside: with the pattern ``token``, ``hf_token``, ``authToken``, ``token2`` and
``token_value`` are redacted and ``tokens``, ``tokens_per_second`` and
``token_count`` are not. Words are split at ``_``, ``-``, ``.``, spaces,
digits and camelCase humps, case-insensitively; a key longer than
``MAX_KEY_SCAN`` characters is judged by its last ``MAX_KEY_SCAN``. The value is
replaced by ``"<redacted>"``; mappings are searched at any depth, also inside
lists (of lists).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Final

from ._sanitize import REDACTED

__all__ = ["DEFAULT_REDACT_KEYS", "QUALIFIERS", "REDACTED", "Redactor", "words"]

#: The default ``Config.redact_keys``.
DEFAULT_REDACT_KEYS: Final = (
    "password",
    "passwd",
    "pwd",
    "pass",
    "passphrase",
    "secret",
    "token",
    "api_key",
    "apikey",
    "access_key",
    "private_key",
    "secret_key",
    "credential",
    "credentials",
    "auth",
    "authorization",
    "bearer",
    "jwt",
    "cookie",
    "session_id",
    "sessionid",
    "session_key",
)

#: Words after a secret's name that still name the secret (``password_hash``, ``token_value``).
QUALIFIERS: Final = frozenset(
    {
        "b64",
        "base64",
        "enc",
        "encoded",
        "encrypted",
        "hash",
        "hashed",
        "header",
        "headers",
        "hex",
        "key",
        "plain",
        "plaintext",
        "raw",
        "str",
        "string",
        "val",
        "value",
    }
)

#: How much of a (long) key's end decides whether it is secret.
MAX_KEY_SCAN: Final = 512

_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
_CACHE_LIMIT = 4096
_CACHE_KEY_LIMIT = 256


def words(key: str) -> tuple[str, ...]:
    """The lower-case words of a key (``hfToken`` -> ``('hf', 'token')``)."""
    return tuple(w.lower() for w in _WORDS.findall(key))


class Redactor:
    """Decides, with a bounded cache, which keys are secret."""

    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns = tuple(p for p in (words(str(p)) for p in patterns) if p)
        self._cache: dict[str, bool] = {}
        #: Keys judged so far (secret: True); read by the writer's fast paths, written only by ``secret``.
        self.judged = self._cache

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def _ends_with_pattern(self, parts: tuple[str, ...]) -> bool:
        return any(len(parts) >= len(p) and parts[-len(p) :] == p for p in self.patterns)

    def secret(self, key: str) -> bool:
        known = self._cache.get(key)
        if known is not None:
            return known
        parts = words(key[-MAX_KEY_SCAN:])
        found = self._ends_with_pattern(parts)
        while not found and parts and (parts[-1] in QUALIFIERS or parts[-1].isdigit()):
            parts = parts[:-1]
            found = self._ends_with_pattern(parts)
        if len(self._cache) < _CACHE_LIMIT and len(key) <= _CACHE_KEY_LIMIT:
            self._cache[key] = found
        return found

    def apply(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """``attrs`` (JSON-safe, string keys) with secret values replaced; copies only if needed."""
        out: dict[str, Any] | None = None
        for key, value in attrs.items():
            if self.secret(key):
                replacement: Any = REDACTED
            elif type(value) is dict or type(value) is list:
                replacement = self._nested(value)
                if replacement is value:
                    continue
            else:
                continue
            if out is None:
                out = dict(attrs)
            out[key] = replacement
        return attrs if out is None else out

    def _nested(self, value: Any) -> Any:
        if type(value) is dict:
            return self.apply(value)
        if type(value) is list:
            items = [self._nested(v) for v in value]
            return value if all(a is b for a, b in zip(items, value, strict=True)) else items
        return value
