"""Shared machinery of the backends for experiment trackers (TensorBoard, MLflow, W&B).

:class:`TrackerBackend` turns records into a tracker's vocabulary: scalars
against the step, text for errors, a summary at the end. It runs the tracker
on a thread of its own behind a bounded queue, so a slow tracker (an HTTP
server, a full disk) delays neither training nor traintrace's files; when the
queue is full, points are dropped and counted. What goes where is in
docs/integrations/trackers.md.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from .._config import BackendConfig, ConfigError
from .._names import EventName, RecordKind, SpanName, Verbosity
from ._base import Record

log = logging.getLogger("traintrace.lib")

PREFIX = "traintrace/"

#: training_iterations fields and their tracker names (seconds become milliseconds for steps).
_STEP_FIELDS: dict[str, tuple[str, float]] = {
    "average_iteration_time": ("step_time_ms", 1e3),
    "iteration_time_p50": ("step_time_p50_ms", 1e3),
    "iteration_time_p90": ("step_time_p90_ms", 1e3),
    "iteration_time_p99": ("step_time_p99_ms", 1e3),
    "iteration_time_min": ("step_time_min_ms", 1e3),
    "iteration_time_max": ("step_time_max_ms", 1e3),
    "average_dataloader_time": ("data_loading_ms", 1e3),
    "average_forward_time": ("forward_ms", 1e3),
    "average_backward_time": ("backward_ms", 1e3),
    "average_optimizer_update_time": ("optimizer_step_ms", 1e3),
    "average_zero_grad_time": ("zero_grad_ms", 1e3),
    "iterations_per_second": ("iterations_per_second", 1.0),
    "samples_per_second": ("samples_per_second", 1.0),
    "tokens_per_second": ("tokens_per_second", 1.0),
    "tflops": ("tflops", 1.0),
    "mfu": ("mfu", 1.0),
    "checkpoint_time": ("checkpoint_time_s", 1.0),
    "validation_time": ("validation_time_s", 1.0),
}
#: training_iterations fields that are counters or bookkeeping, not the user's metrics.
_NOT_METRICS = frozenset(
    {
        "interval",
        "current_iteration",
        "num_iterations",
        "elapsed_time",
        "batch_size",
        "final",
        "completed_steps",
        "skipped_steps",
        "consumed_samples",
        "consumed_tokens",
        "last_step",
        "failed_steps",
        "total_checkpoint_time",
        "total_validation_time",
    }
)
#: Spans whose durations are logged, under traintrace/<kind>/<name>_s.
_TIMED_SPANS: dict[str, str] = {
    SpanName.CHECKPOINT_SAVE_SYNC: "checkpoint",
    SpanName.CHECKPOINT_SAVE_ASYNC: "checkpoint",
    SpanName.CHECKPOINT_SAVE_FINALIZATION: "checkpoint",
    SpanName.CHECKPOINT_LOAD: "checkpoint",
    SpanName.VALIDATION: "validation",
    SpanName.TEST: "validation",
}


class _FrameworkLogs:
    """Set by the Lightning and Hugging Face callbacks when the framework's own loggers are active.

    Then the trackers leave the user's metrics (loss, learning rate, ...) to the
    framework and log only traintrace's figures, so nothing is logged twice.
    """

    def __init__(self) -> None:
        self.active = False
        self.who = ""


framework_logs = _FrameworkLogs()


def framework_logs_metrics(who: str, active: bool = True) -> None:
    """Called by an integration: ``who``'s loggers send the training metrics (or no longer do)."""
    framework_logs.active = active
    framework_logs.who = who if active else ""


@dataclass
class TrackerConfig(BackendConfig):
    """Fields every tracker backend shares. Rank 0 only by default.

    ``metrics``: also log the user's metrics (``loss`` and other numbers given
    to iterations), averaged per interval, under their own names. Left to the
    framework when a Lightning or Hugging Face callback sees the framework's
    loggers active (docs/integrations/trackers.md). ``queue_size``: points
    waiting for the tracker before new ones are dropped (and counted).
    """

    type: ClassVar[str] = ""
    ranks: Any = "0"
    #: Tracing: the iteration records say which step an error happened in (nothing is logged per step).
    verbosity: Verbosity | str | int = Verbosity.TRACING
    metrics: bool = True
    queue_size: int = 10000

    def validate(self, where: str) -> None:
        super().validate(where)
        if not isinstance(self.metrics, bool):
            raise ConfigError(f"{where}.metrics: expected true or false, got {self.metrics!r}")
        if isinstance(self.queue_size, bool) or not isinstance(self.queue_size, int) or self.queue_size < 1:
            raise ConfigError(f"{where}.queue_size: expected a positive integer, got {self.queue_size!r}")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


class Translator:
    """Records in, tracker points out: ("scalars", step, {name: value}), ("text", step, tag, text),
    ("summary", {name: value}). Pure logic; the tests call it directly too."""

    def __init__(self, metrics: bool = True) -> None:
        self.metrics = metrics
        self.step = 0
        self.start_ts: int | None = None
        self.last_ts: int | None = None
        self.step_seconds = 0.0
        self.errors = 0
        self.last: dict[str, Any] = {}
        self.iteration_step: int | None = None
        self.summarised = False

    def __call__(self, record: Record) -> list[tuple[Any, ...]]:
        kind = record.get("kind")
        ts = record.get("ts")
        if isinstance(ts, int):
            if self.start_ts is None:
                self.start_ts = ts
            self.last_ts = max(self.last_ts or ts, ts)
        if kind == RecordKind.EVENT and record.get("name") == EventName.TRAINING_ITERATIONS:
            return self._interval(record.get("attrs") or {})
        if kind in (RecordKind.SPAN, RecordKind.END) and record.get("name") in _TIMED_SPANS:
            dur = record.get("dur")
            if not isinstance(dur, int):
                return []
            if isinstance(ts, int) and kind == RecordKind.SPAN:
                self.last_ts = max(self.last_ts or 0, ts + dur)
            name = str(record["name"])
            return [("scalars", self.step, {f"{PREFIX}{_TIMED_SPANS[name]}/{name}_s": dur / 1e9})]
        if record.get("name") == SpanName.ITERATION:
            # Iteration records (tracing level) come before their children's records and errors: they say
            # which step an error happened in. Nothing is logged per step.
            attrs = record.get("attrs") or {}
            step = attrs.get("step", attrs.get("current_iteration"))
            if isinstance(step, int) and not isinstance(step, bool):
                self.iteration_step = step
            return []
        if kind == RecordKind.ERROR:
            self.errors += 1
            head = f"{record.get('error_type') or record.get('name')}: {record.get('message') or ''}".strip()
            stack = record.get("stack")
            text = f"{head}\n\n{stack}" if stack else head
            step = self.iteration_step if self.iteration_step is not None else self.step
            return [
                ("text", step, f"{PREFIX}error_text", text),  # not the count's tag: one kind of data per tag
                ("scalars", step, {f"{PREFIX}errors": float(self.errors)}),
            ]
        if kind == RecordKind.CLOSE and not self.summarised:
            return [("summary", self.summary())]
        return []

    def _interval(self, attrs: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        step = attrs.get("current_iteration")
        if isinstance(step, int) and not isinstance(step, bool):
            self.step = step
        values: dict[str, float] = {}
        for key, value in attrs.items():
            number = _number(value)
            if number is None:
                continue
            known = _STEP_FIELDS.get(key)
            if known is not None:
                values[PREFIX + known[0]] = number * known[1]
            elif key not in _NOT_METRICS and self.metrics and not framework_logs.active:
                values[key] = number
        interval = attrs.get("interval")
        mean = _number(attrs.get("average_iteration_time"))
        if isinstance(interval, int) and mean is not None:
            self.step_seconds += interval * mean
        self.last = dict(attrs)
        return [("scalars", self.step, values)] if values else []

    def summary(self) -> dict[str, float]:
        """The run's totals: goodput = time in training steps / the stream's wall time (0..1)."""
        self.summarised = True
        out: dict[str, float] = {f"{PREFIX}errors": float(self.errors)}
        if self.start_ts is not None and self.last_ts is not None and self.last_ts > self.start_ts:
            wall = (self.last_ts - self.start_ts) / 1e9
            out[f"{PREFIX}wall_time_s"] = wall
            out[f"{PREFIX}goodput"] = min(self.step_seconds / wall, 1.0)
        for key in (
            "completed_steps",
            "failed_steps",
            "skipped_steps",
            "consumed_samples",
            "consumed_tokens",
            "total_checkpoint_time",
            "total_validation_time",
        ):
            number = _number(self.last.get(key))
            if number is not None:
                out[PREFIX + key] = number
        return out


class TrackerBackend:
    """A backend that feeds a tracker on its own thread. Subclasses implement the four ``_tool_*`` methods.

    ``_tool_open`` runs in ``open()`` (at ``configure()``, where a failure is a
    configuration error); the others run on the tracker thread, where a failure
    is logged once and counted.
    """

    name: ClassVar[str] = "tracker"

    def __init__(self, *, verbosity: int = Verbosity.INFO, metrics: bool = True, queue_size: int = 10000) -> None:
        self.verbosity = int(verbosity)
        self._translate = Translator(metrics)
        self._queue: queue.Queue[tuple[Any, ...] | None] = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self.dropped = 0
        self.failures = 0
        self.abandoned = 0
        self._closing = False
        self._settled = False
        self._deadline = 0.0

    # -- what subclasses implement (tracker thread, except _tool_open) -------------------
    def _tool_open(self, header: Record) -> None:
        raise NotImplementedError

    def _tool_scalars(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def _tool_text(self, step: int, tag: str, text: str) -> None:
        raise NotImplementedError

    def _tool_summary(self, values: dict[str, float]) -> None:
        raise NotImplementedError

    def _tool_flush(self) -> None:
        return None

    def _tool_close(self) -> None:
        return None

    # -- the backend protocol (writer thread) --------------------------------------------
    def open(self, header: Record) -> None:
        self._translate(header)
        self._tool_open(header)
        self._thread = threading.Thread(target=self._serve, name=f"traintrace-{self.name}", daemon=True)
        self._thread.start()

    def write(self, records: Sequence[Record]) -> None:
        for record in records:
            for point in self._translate(record):
                try:
                    self._queue.put_nowait(point)
                except queue.Full:
                    self.dropped += 1

    def flush(self) -> None:
        try:
            self._queue.put_nowait(("flush",))
        except queue.Full:
            pass

    # -- close: traintrace's shared budget (docs/backends.md, "begin_close" and "settle") ---------
    #: The share of traintrace's close budget this backend asks for (seconds).
    close_timeout: float = 10.0

    def begin_close(self, deadline: float | None) -> None:
        """Queue the run's summary and the end; the tracker thread finishes by ``deadline``."""
        if self._closing:
            return
        self._closing = True
        self._deadline = time.monotonic() + self.close_timeout if deadline is None else deadline
        for point in (("summary", self._translate.summary()), None):
            try:
                self._queue.put(point, timeout=max(self._deadline - time.monotonic(), 0.0))
            except queue.Full:
                self.dropped += 1

    def settle(self) -> None:
        """Wait for the tracker thread until the deadline; what is left is counted as abandoned."""
        thread = self._thread
        if thread is None or self._settled:
            return
        self._settled = True
        thread.join(max(self._deadline - time.monotonic(), 0.0))
        if thread.is_alive():
            self.abandoned = self._queue.qsize()
            log.warning("traintrace: %s did not finish in time; %d points not written", self.name, self.abandoned)

    def losses(self) -> dict[str, int]:
        """Points lost so far: queue full (tracker too slow), failed (tracker raised), abandoned at close."""
        return {"queue_full": self.dropped, "failed": self.failures, "abandoned": self.abandoned}

    def close(self) -> None:
        self.begin_close(None)
        self.settle()

    # -- tracker thread ------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            point = self._queue.get()
            if point is None:
                break
            self._apply(point)
        self._apply(("close",))

    def _apply(self, point: tuple[Any, ...]) -> None:
        try:
            what = point[0]
            if what == "scalars":
                self._tool_scalars(point[1], point[2])
            elif what == "text":
                self._tool_text(point[1], point[2], point[3])
            elif what == "summary":
                self._tool_summary(point[1])
            elif what == "flush":
                self._tool_flush()
            elif what == "close":
                self._tool_close()
        except Exception as exc:  # noqa: BLE001 - a failing tracker must not stop the others
            self.failures += 1
            if self.failures == 1:
                log.warning(
                    "traintrace: %s failed (%s: %s); its points are counted and skipped",
                    self.name,
                    type(exc).__name__,
                    exc,
                )


def missing_extra(tool: str, extra: str) -> ConfigError:
    """The configuration error for a tracker whose package is not installed."""
    return ConfigError(f"backends.{extra}: {tool} is not installed: pip install 'traintrace[{extra}]'")
