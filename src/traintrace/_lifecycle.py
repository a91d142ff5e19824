"""Lifecycle event types and what subscribers receive: shared by ``events`` and ``publisher``.

A leaf module (standard library only), so that the recording side
(:mod:`traintrace.events`) and the delivering side
(:mod:`traintrace.publisher`) both import it and not each other.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any

__all__ = ["EventSource", "EventType", "LifecycleEvent", "build_event"]


class EventType(str, enum.Enum):
    """The lifecycle event types. The value is the record's ``name``."""

    JOB_START = "job_start"
    JOB_END = "job_end"
    WORKER_START = "worker_start"
    WORKER_EXIT = "worker_exit"
    WORKER_FAILURE = "worker_failure"
    WORKER_RESTART = "worker_restart"
    RENDEZVOUS_START = "rendezvous_start"
    RENDEZVOUS_COMPLETE = "rendezvous_complete"
    RENDEZVOUS_UPDATE = "rendezvous_update"
    RANKS_ASSIGNED = "ranks_assigned"
    NODE_JOIN = "node_join"
    NODE_LEAVE = "node_leave"
    HANG_SUSPECTED = "hang_suspected"
    CHECKPOINT_SAVED = "checkpoint_saved"
    AGENT_EXIT = "agent_exit"
    ELASTIC_METRIC = "elastic_metric"

    def __str__(self) -> str:
        return str(self.value)


class EventSource(str, enum.Enum):
    """Who recorded a lifecycle event: the launcher's agent, or a worker."""

    AGENT = "agent"
    WORKER = "worker"

    def __str__(self) -> str:
        return str(self.value)


_TYPES: dict[str, EventType] = {member.value: member for member in EventType}


@dataclass(frozen=True)
class LifecycleEvent:
    """What a subscriber receives."""

    name: str
    source: str
    timestamp_ns: int
    worker_id: int | str | None = None
    exit_code: int | None = None
    data: dict[str, Any] = field(default_factory=dict)
    identity: dict[str, Any] = field(default_factory=dict)

    @property
    def type(self) -> EventType | str:
        """The :class:`EventType`, or the name for a custom type."""
        return _TYPES.get(self.name, self.name)

    @property
    def timestamp(self) -> float:
        """Seconds since the epoch."""
        return self.timestamp_ns / 1e9

    @property
    def rank(self) -> int | None:
        value = self.identity.get("rank")
        return value if isinstance(value, int) else None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "source": self.source, "timestamp_ns": self.timestamp_ns}
        if self.worker_id is not None:
            out["worker_id"] = self.worker_id
        if self.exit_code is not None:
            out["exit_code"] = self.exit_code
        out.update(self.identity)
        if self.data:
            out["data"] = self.data
        return out


def build_event(item: tuple[Any, ...]) -> LifecycleEvent:
    """The subscriber's view of a queued event (on the dispatcher thread)."""
    name, mono, attrs, full = item
    wall = time.time_ns() - (perf_counter_ns() - mono)
    identity = {**full}
    for key in ("rank", "local_rank", "node_rank", "restart"):
        if key in attrs:
            identity[key] = attrs[key]
    extra = {k: v for k, v in attrs.items() if k not in _RESERVED}
    identity.update(extra)
    data = attrs.get("data")
    return LifecycleEvent(
        name=name,
        source=attrs.get("source", "worker"),
        timestamp_ns=wall,
        worker_id=attrs.get("worker_id"),
        exit_code=attrs.get("exit_code"),
        data=dict(data) if data else {},
        identity=identity,
    )


_RESERVED = frozenset({"source", "worker_id", "exit_code", "data", "rank", "local_rank", "node_rank", "restart"})
