"""Backends: where records go. Write your own by implementing :class:`Backend`."""

from ._base import Backend, BaseBackend, Record, SpanListener
from ._file import FileBackend
from ._log import LogBackend
from ._memory import MemoryBackend

__all__ = [
    "Backend",
    "BaseBackend",
    "FileBackend",
    "LogBackend",
    "MemoryBackend",
    "Record",
    "SpanListener",
]
