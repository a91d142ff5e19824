"""``traintrace-run --metrics-port``: Prometheus metrics for a node's ranks, read from their files.

The launcher's process tails the ranks' JSON-lines files incrementally (only
the bytes added since the last scrape are read) and serves, per rank, the
latest step, step time, throughput, last progress time and counts of errors
and suspected hangs at ``/metrics`` (``prometheus-client``, extra
``prometheus``). The workers do nothing for it. See
docs/integrations/prometheus.md.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._names import EventName, SpanName

log = logging.getLogger("traintrace.lib")

#: Record lines worth parsing (the rest of a rank's file is skipped without decoding).
_WANTED = (
    b'"kind":"header"',
    b'"kind":"error"',
    b'"name":"%s"' % SpanName.ITERATION.encode(),
    b'"%s"' % EventName.TRAINING_ITERATIONS.encode(),
    b'"kind":"close"',
)
_HANG = EventName.HANG_SUSPECTED
_MAX_LINE = 16 * 1024 * 1024


@dataclass
class RankState:
    """What the exporter knows about one rank, from its file."""

    rank: int
    job: str = ""
    host: str = ""
    restart: int = 0
    step: int | None = None
    step_seconds: float | None = None
    step_p90_seconds: float | None = None
    samples_per_second: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    last_progress: float | None = None  # epoch seconds
    errors: int = 0
    hangs: int = 0
    closed: bool = False


@dataclass
class _Tail:
    path: Path
    offset: int = 0
    partial: bytes = b""
    ranks: set[int] = field(default_factory=set)
    rank: int | None = None
    foreign: bool = False  # another node's rank, or the agent


class NodeFiles:
    """Tails the rank files of one job folder; ``host`` keeps only this node's ranks (None: all)."""

    def __init__(self, folder: str | os.PathLike[str], host: str | None = None, chunk: int = 8 << 20) -> None:
        self.folder = Path(folder)
        self.host = host
        self.chunk = chunk
        self.ranks: dict[int, RankState] = {}
        self._tails: dict[Path, _Tail] = {}
        self._lock = threading.Lock()

    def poll(self) -> dict[int, RankState]:
        """Read what was appended since the last call; returns the ranks' states."""
        with self._lock:
            if self.folder.is_dir():
                for path in sorted(self.folder.rglob("*.jsonl")):
                    if path not in self._tails and not path.name.startswith("agent"):
                        self._tails[path] = _Tail(path)
            for tail in self._tails.values():
                if not tail.foreign:
                    self._read(tail)
            return dict(self.ranks)

    def _read(self, tail: _Tail) -> None:
        try:
            with tail.path.open("rb") as handle:
                handle.seek(tail.offset)
                while True:
                    data = handle.read(self.chunk)
                    if not data:
                        break
                    tail.offset += len(data)
                    lines = (tail.partial + data).split(b"\n")
                    tail.partial = lines.pop()
                    if len(tail.partial) > _MAX_LINE:
                        tail.partial = b""
                    for line in lines:
                        if any(marker in line for marker in _WANTED):
                            self._line(tail, line)
                        if tail.foreign:
                            return
        except OSError as exc:
            log.debug("traintrace: cannot read %s: %s", tail.path, exc)

    def _line(self, tail: _Tail, line: bytes) -> None:
        try:
            record: dict[str, Any] = json.loads(line)
        except ValueError:
            return
        if not isinstance(record, dict):
            return
        kind = record.get("kind")
        if kind == "header":
            rank = record.get("rank")
            if record.get("role") == "agent" or not isinstance(rank, int):
                tail.foreign = True
                return
            if self.host is not None and record.get("host") != self.host:
                tail.foreign = True
                return
            state = self.ranks.get(rank)
            if state is None:
                state = self.ranks[rank] = RankState(rank)
            restart = record.get("restart")
            if isinstance(restart, int) and restart >= state.restart:
                state.restart = restart
                state.closed = False
            state.job = str(record.get("job") or "")
            state.host = str(record.get("host") or "")
            tail.rank = rank
            return
        state = self.ranks.get(tail.rank) if tail.rank is not None else None
        if state is None:
            return
        ts = record.get("ts")
        if kind == "error":
            name = record.get("name")
            if name == _HANG or record.get("error_type") == _HANG:
                state.hangs += 1
            else:
                state.errors += 1
        elif kind == "close":
            state.closed = True
        elif record.get("name") == SpanName.ITERATION and kind in ("span", "end"):
            step = (record.get("attrs") or {}).get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                state.step = step
            dur = record.get("dur")
            if isinstance(ts, int):
                end = ts + (dur if kind == "span" and isinstance(dur, int) else 0)
                state.last_progress = max(state.last_progress or 0.0, end / 1e9)
        elif kind == "event" and record.get("name") == "training_iterations":
            attrs = record.get("attrs") or {}
            step = attrs.get("current_iteration")
            if isinstance(step, int) and not isinstance(step, bool) and (state.step is None or step > state.step):
                state.step = step
            state.step_seconds = _number(attrs.get("average_iteration_time"), state.step_seconds)
            state.step_p90_seconds = _number(attrs.get("iteration_time_p90"), state.step_p90_seconds)
            state.samples_per_second = _number(attrs.get("samples_per_second"), state.samples_per_second)
            state.tokens_per_second = _number(attrs.get("tokens_per_second"), state.tokens_per_second)
            state.mfu = _number(attrs.get("mfu"), state.mfu)
            if isinstance(ts, int):
                state.last_progress = max(state.last_progress or 0.0, ts / 1e9)


def _number(value: Any, default: float | None) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return float(value)


_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("step", "traintrace_step", "Latest training step the rank finished."),
    ("step_seconds", "traintrace_step_time_seconds", "Mean step time over the latest statistics interval."),
    ("step_p90_seconds", "traintrace_step_time_p90_seconds", "90th percentile step time, latest interval."),
    ("samples_per_second", "traintrace_samples_per_second", "Samples per second, latest interval."),
    ("tokens_per_second", "traintrace_tokens_per_second", "Tokens per second, latest interval."),
    ("mfu", "traintrace_mfu", "Model FLOPs utilisation (0..1), latest interval."),
    (
        "last_progress",
        "traintrace_last_progress_timestamp_seconds",
        "When the rank last finished a step (Unix time); alert on time() minus this.",
    ),
    ("restart", "traintrace_restart", "The rank's current restart count."),
)


class _Collector:
    """prometheus-client custom collector: polls the files at each scrape."""

    def __init__(self, files: NodeFiles) -> None:
        self.files = files

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        states = sorted(self.files.poll().values(), key=lambda s: s.rank)
        labels = ["job", "rank"]
        for attr, name, doc in _GAUGES:
            family = GaugeMetricFamily(name, doc, labels=labels)
            for state in states:
                value = getattr(state, attr)
                if value is not None:
                    family.add_metric([state.job, str(state.rank)], float(value))
            yield family
        closed = GaugeMetricFamily(
            "traintrace_stream_closed", "1 when the rank's stream closed cleanly.", labels=labels
        )
        errors = CounterMetricFamily("traintrace_errors", "Errors the rank recorded.", labels=labels)
        hangs = CounterMetricFamily("traintrace_hangs", "Hangs the rank's watchdog suspected.", labels=labels)
        for state in states:
            key = [state.job, str(state.rank)]
            closed.add_metric(key, 1.0 if state.closed else 0.0)
            errors.add_metric(key, float(state.errors))
            hangs.add_metric(key, float(state.hangs))
        yield closed
        yield errors
        yield hangs
        yield GaugeMetricFamily("traintrace_ranks", "Ranks seen on this node.", value=float(len(states)))


class MetricsServer:
    """Serves ``/metrics`` for the ranks whose files are under ``folder``; ``close()`` stops it."""

    def __init__(self, folder: str | os.PathLike[str], port: int, addr: str = "", host: str | None = None) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self.files = NodeFiles(folder, host)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self.files))
        started: Any = start_http_server(port, addr=addr or "0.0.0.0", registry=self.registry)
        self._server: Any = started[0] if isinstance(started, tuple) else None
        self.port = int(self._server.server_address[1]) if self._server is not None else port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def require() -> None:
    """Raise ImportError with the extra to install when prometheus-client is missing."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ImportError("--metrics-port needs prometheus-client: pip install 'traintrace[prometheus]'") from None
