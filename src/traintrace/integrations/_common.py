"""Helpers the framework integrations share: batch inspection, sizes, configuration."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .._config import Config
from .._names import SpanStatus
from .._recorder import Recorder, Span, warn_once
from .._setup import configure, get_recorder

#: Keys that hold token ids in a batch mapping, most common first.
TOKEN_KEYS = ("input_ids", "tokens", "token_ids")


def missing_extra(extra: str, package: str, exc: ImportError) -> ImportError:
    """The error raised when an integration's framework is not installed."""
    error = ImportError(f"traintrace.integrations.{extra} needs {package}: pip install 'traintrace[{extra}]'")
    error.__cause__ = exc
    return error


def _first_dim(value: Any) -> int | None:
    try:
        shape = value.shape
    except AttributeError:
        return None
    try:
        return int(shape[0]) if len(shape) > 0 else None
    except (TypeError, ValueError, IndexError):
        return None


def _numel(value: Any) -> int | None:
    numel = getattr(value, "numel", None)
    if callable(numel):
        try:
            return int(numel())
        except (TypeError, ValueError):
            return None
    size = getattr(value, "size", None)
    return int(size) if isinstance(size, int) else None


def _mapping_info(batch: Mapping[str, Any]) -> tuple[int | None, int | None]:
    for key in TOKEN_KEYS:
        ids = batch.get(key)
        if ids is not None and hasattr(ids, "shape"):
            return _first_dim(ids), _numel(ids)
    for value in batch.values():
        size = _first_dim(value)
        if size is not None:
            return size, None
    return None, None


def batch_info(batch: Any) -> tuple[int | None, int | None]:
    """(batch size, tokens) read from a batch without touching its data.

    Only shapes are read, so no device synchronisation happens. A mapping
    with ``input_ids`` (or ``tokens``) gives both; otherwise the first
    array-like found (a tensor, a tuple/list of them, a mapping of them)
    gives the batch size and tokens stay unknown.
    """
    kind = type(batch)
    if kind is tuple or kind is list:
        # The common case first, without the loop's slice and calls: (inputs, targets) of tensors.
        shape = getattr(batch[0], "shape", None) if batch else None
        if shape is not None:
            try:
                if len(shape) > 0:
                    return int(shape[0]), None
            except (TypeError, ValueError, IndexError):
                pass
        for item in batch[:4]:
            size = _first_dim(item)
            if size is not None:
                return size, None
            if isinstance(item, Mapping):
                return _mapping_info(item)
        return None, None
    if kind is dict or isinstance(batch, Mapping):
        return _mapping_info(batch)
    size = _first_dim(batch)
    if size is not None:
        return size, None
    if isinstance(batch, list | tuple):  # namedtuples and other sequences
        return batch_info(list(batch[:4]))
    return None, None


def safe_call(fn: Callable[[Any], Any] | None, batch: Any, what: str) -> int | None:
    """``fn(batch)`` as an int, or None; a failing user function warns once."""
    if fn is None:
        return None
    try:
        value = fn(batch)
        return None if value is None else int(value)
    except Exception as exc:  # noqa: BLE001 - a user's helper must not break training
        warn_once(f"{what}_fn", f"{what}_fn raised {type(exc).__name__}: {exc}; {what} not recorded")
        return None


def ensure_recorder(
    config: Config | None,
    *,
    settings: Mapping[str, Any],
    rank: int,
    world_size: int,
    local_rank: int | None,
    node_rank: int | None,
) -> tuple[Recorder, bool]:
    """The recorder to use on this rank, configuring one if needed.

    Returns (recorder, configured_here). An existing recorder is kept when its
    rank and world size agree with the framework's; otherwise (a process that
    configured before the framework knew its rank) it is configured again with
    the framework's identity. A bad setting raises :class:`ConfigError`, as
    ``configure()`` does.
    """
    current = get_recorder()
    if current is not None:
        identity = current.identity
        if identity is None or (identity.rank == rank and identity.world_size == world_size):
            return current, False
        warn_once(
            "integration_rank",
            f"traintrace was configured as rank {identity.rank} of {identity.world_size} but the "
            f"trainer runs rank {rank} of {world_size}; configuring again with the trainer's ranks",
        )
        base = current.config
    else:
        base = config if config is not None else Config()
    identity_settings: dict[str, Any] = {"rank": rank, "world_size": world_size}
    if local_rank is not None:
        identity_settings["local_rank"] = local_rank
    if node_rank is not None:
        identity_settings["node_rank"] = node_rank
    return configure(base, **{**dict(settings), **identity_settings}), True


def record_finished(  # noqa: PLR0917 - positional on purpose: called per training phase
    rec: Recorder,
    name: str,
    level: int,
    t0: int,
    t1: int,
    parent: Span | None,
    attrs: dict[str, Any] | None = None,
    status: str = SpanStatus.OK,
) -> Span | None:
    """Record a span that has already ended, from two ``perf_counter_ns`` readings.

    For leaf phases timed between two framework hooks (forward, backward,
    optimizer step, the wait for a batch): one queue item instead of a start
    and a stop, and no change to the current span, so it costs about a third
    of an open/close pair. Spans opened by user code during the phase nest
    under ``parent`` instead.
    """
    return rec.record_span(name, t0, t1, parent=parent, metrics=attrs, level=level, status=status)
