"""Iteration statistics, computed on the writer thread from the spans it already sees.

Nothing here runs on the training thread: the iteration span costs the same
with statistics on or off. :class:`IterationStats` is a pipeline observer; it
is shown every span as it ends, keeps per-interval sums, a bounded histogram
for quantiles and the run's counters, and every ``log_interval`` steps (and at
the end of the training loop) adds a ``training_iterations`` event.

Tensors given as metrics (a loss on the GPU) are never converted per step: the
iteration records that hold them are kept back, and all the tensors of an
interval are resolved together, with one stacked copy per device and dtype,
when the interval's event is built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any, Final

from ._checkpoint import checkpoint_path, file_system_space, measure_size
from ._histogram import LogHistogram
from ._names import EventName, SpanName, SpanStatus, Verbosity
from ._peaks import peak_for
from ._recorder import Span
from ._tensors import detach, is_tensor, read_if_cpu_float, resolve_tensors

if TYPE_CHECKING:
    from ._pipeline import Pipeline

Out = list[tuple[int, dict[str, Any]]]

#: Sub-phase spans and the field of their mean duration (reference names).
PHASE_FIELDS: Final[dict[str, str]] = {
    SpanName.DATA_LOADING: "average_dataloader_time",
    SpanName.FORWARD: "average_forward_time",
    SpanName.BACKWARD: "average_backward_time",
    SpanName.OPTIMIZER_STEP: "average_optimizer_update_time",
    SpanName.ZERO_GRAD: "average_zero_grad_time",
}

#: Device (GPU) time of phases and iterations, where device timing measured it (docs/insight.md).
DEVICE_FIELDS: Final[dict[str, str]] = {
    SpanName.ITERATION: "average_iteration_device_time",
    **{name: field.replace("_time", "_device_time") for name, field in PHASE_FIELDS.items()},
}

#: Spans whose time is taken out of throughput, and where it is reported.
EXCLUDED_FIELDS: Final[dict[str, str]] = {
    SpanName.CHECKPOINT_SAVE_SYNC: "checkpoint_time",
    SpanName.CHECKPOINT_SAVE_ASYNC: "checkpoint_time",
    SpanName.CHECKPOINT_LOAD: "checkpoint_time",
    SpanName.VALIDATION: "validation_time",
    SpanName.TEST: "validation_time",
}

_STEP_KEYS: Final = ("step", "current_iteration", "iteration")
#: Iteration attributes that are read, not averaged.
RESERVED: Final = frozenset(
    {"step", "current_iteration", "iteration", "num_iterations", "batch_size", "tokens", "flops", "skipped"}
)
_COUNTED: Final = frozenset({"tokens", "batch_size"})
_BATCH: Final = 1024
#: At most this many metrics get a ``non_finite_metric`` event in a process.
_MAX_NON_FINITE: Final = 16
_QUANTILES: Final = (0.5, 0.9, 0.99)
_FAILED: Final = frozenset({SpanStatus.ERROR, SpanStatus.TERMINATED})
_PLAIN_TYPES: Final = frozenset({int, float, str, bool, type(None)})
_DETAILED: Final = frozenset({SpanName.CHECKPOINT_SAVE_SYNC, SpanName.CHECKPOINT_SAVE_FINALIZATION})
#: Span names whose end the statistics handle in Python (the native encoder counts plain iterations
#: and sub-phases itself, see ``native_state``/``absorb``, and skips the names the statistics ignore).
PYTHON_NAMES: Final = frozenset({*EXCLUDED_FIELDS, *_DETAILED, SpanName.TRAINING_LOOP})


# ---------------------------------------------------------------- statistics


def _tensor_field(key: str) -> str | None:
    """Where a tensor's value goes once read: a metric mean, a count, or nowhere."""
    if key in _COUNTED or key not in RESERVED:
        return key
    return None


def _read_cpu_floats(values: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """``values`` with its one-element float tensors on the CPU read, and whether other tensors are left.

    A CPU float costs a read of memory, and written at once its record stays in order; the
    others (on an accelerator: a device sync per read) are held for the interval's one read.
    """
    out: dict[str, Any] = {}
    left = False
    for key, value in values.items():
        if type(value) not in _PLAIN_TYPES and is_tensor(value):
            number = read_if_cpu_float(value)
            left = left or number is None
            out[key] = value if number is None else number
        else:
            out[key] = value
    return out, left


def _number(value: Any) -> float | None:
    kind = type(value)
    if kind is int or kind is float:
        return float(value)
    return None


class IterationStats:
    """The pipeline observer that turns iteration spans into interval events."""

    def __init__(self, pipeline: Pipeline, log_interval: int, peak_tflops: float | None) -> None:
        self.pipeline = pipeline
        self.log_interval = log_interval
        self.peak_tflops = peak_tflops
        #: (monotonic ns from which it applies, values): defaults for every step.
        self.step_info: tuple[tuple[int, dict[str, Any]], ...] = ()
        self._max_route_level = pipeline.max_route_level
        # counters of the run
        self.completed_steps = 0
        self.skipped_steps = 0
        self.failed_steps = 0
        self.checkpoint_ns = 0
        self.validation_ns = 0
        self.consumed_samples = 0
        self.consumed_tokens = 0
        self.last_step: int | None = None
        #: ``_encode.Encoder.interval_quantiles`` once the native encoder counts iterations: it keeps the
        #: histogram's buckets of the interval until the interval's quantiles are asked for.
        self.native_quantiles: Callable[..., list[float] | None] | None = None
        #: perf_counter_ns of the latest progress seen: an iteration or a long phase that completed.
        #: One that an exception ended is not progress (the hang watchdog would call a hang resolved).
        self.last_progress = 0
        #: True after a training loop ended, until the next iteration: nothing to watch.
        self.loop_ended = False
        self.device_name: str | None = None
        #: Set by the watchdog while it suspects a hang: flushes then leave tensors unread.
        self.quiet_flush = False
        self._reset_interval()
        self._interval_start: int | None = None
        self._windows: list[tuple[int, int, str]] = []
        self._loop_id = 0
        self._ident = 0
        #: Float metrics whose ``non_finite_metric`` event was added (the first NaN or infinite value only).
        self.non_finite: set[str] = set()

    def _reset_interval(self) -> None:
        self._steps = 0
        self._sum = 0
        self._hist = LogHistogram()
        #: durations not yet in the histogram, added in batches (at most _BATCH)
        self._durations: list[int] = []
        self._phase_sum: dict[str, int] = {}
        self._phase_count: dict[str, int] = {}
        self._samples = 0
        self._tokens = 0
        self._flops = 0.0
        self._flops_known = True
        self._samples_known = False
        self._tokens_known = False
        self._metric_sum: dict[str, float] = {}
        self._metric_count: dict[str, int] = {}
        self._metric_last: dict[str, Any] = {}
        self._tensors: list[tuple[str | None, Any]] = []
        self._held: list[tuple[Span, bool]] = []
        self._last_t1 = 0
        #: device time of phases whose CUDA events resolved in this interval (``_device_timing``)
        self._device_sum: dict[str, int] = {}
        self._device_count: dict[str, int] = {}

    def device_time(self, name: str, gpu_dur: int) -> None:
        """A phase's device time is known (writer thread; it lags the CPU by up to a write cycle)."""
        field = DEVICE_FIELDS.get(name)
        if field is not None:
            self._device_sum[field] = self._device_sum.get(field, 0) + gpu_dur
            self._device_count[field] = self._device_count.get(field, 0) + 1

    # -- called by the user's thread (through set_step_info) ---------------
    def set_info(self, values: dict[str, Any]) -> None:
        # Rebinding a new tuple keeps the writer's reads consistent without a lock.
        current = self.step_info
        merged = {**current[-1][1], **values} if current else dict(values)
        self.step_info = (*current[-15:], (perf_counter_ns(), merged))

    def _info_at(self, t0: int) -> Mapping[str, Any]:
        info = self.step_info
        if info and info[-1][0] <= t0:
            return info[-1][1]
        for index in range(len(info) - 1, -1, -1):
            if info[index][0] <= t0:
                return info[index][1]
        return info[0][1] if info else {}

    def snapshot(self) -> dict[str, Any]:
        """The run's counters now."""
        return {
            "completed_steps": self.completed_steps,
            "skipped_steps": self.skipped_steps,
            "consumed_samples": self.consumed_samples,
            "consumed_tokens": self.consumed_tokens,
            "last_step": self.last_step,
            "failed_steps": self.failed_steps,
            "total_checkpoint_time": self.checkpoint_ns * 1e-9,
            "total_validation_time": self.validation_ns * 1e-9,
        }

    # -- writer thread -----------------------------------------------------
    def hold(self, span: Span, started: bool) -> bool:
        """Called before an ended span's record is built; True keeps the record back.

        An iteration holding tensors is kept back until its interval's event,
        so its tensors are read together with the others. Checkpoint spans get
        their measured size here, so that it is in their record.
        """
        name = span.name
        if name == SpanName.ITERATION:
            plain = _PLAIN_TYPES
            held = False
            attrs = span.attrs
            if attrs:
                for value in attrs.values():
                    if type(value) not in plain and is_tensor(value):
                        span.attrs, left = _read_cpu_floats(attrs)
                        held = held or left
                        break
            metrics = span.metrics
            if metrics:
                for value in metrics.values():
                    if type(value) not in plain and is_tensor(value):
                        span.metrics, left = _read_cpu_floats(metrics)
                        held = held or left
                        break
            return self._hold_tensors(span, started) if held else False
        if name in _DETAILED:
            self._checkpoint_details(span)
        return False

    def span_ended(self, span: Span, out: Out) -> None:
        """Called for every span in the order the spans ended."""
        name = span.name
        if name == SpanName.ITERATION:
            self._iteration(span, out)
            return
        t1 = span.t1 or span.t0
        field = PHASE_FIELDS.get(name)
        if field is not None:
            if span.status == SpanStatus.INTERRUPTED:  # cut short by something else: no part of the phase's mean
                return
            self._phase_sum[field] = self._phase_sum.get(field, 0) + (t1 - span.t0)
            self._phase_count[field] = self._phase_count.get(field, 0) + 1
            return
        field = EXCLUDED_FIELDS.get(name)
        if field is not None:
            if field == "checkpoint_time":
                self.checkpoint_ns += t1 - span.t0
            else:
                self.validation_ns += t1 - span.t0
            if self._interval_start is not None:
                self._windows.append((span.t0, t1, field))
                del self._windows[:-1024]
            if span.status not in _FAILED:
                self.last_progress = max(self.last_progress, t1)
            if name == SpanName.CHECKPOINT_LOAD:
                self._resumed(span)
            return
        if name == SpanName.TRAINING_LOOP:
            self._loop_id = span.id
            self._ident = span.tid
            self._emit(out, t1, final=True)
            self.loop_ended = True
            self._interval_start = None
            self._windows.clear()
            if span.status not in _FAILED:
                self.last_progress = max(self.last_progress, t1)
            return
        if name.endswith("_initialization") and span.status not in _FAILED:
            self.last_progress = max(self.last_progress, t1)

    def finish(self, out: Out, open_status: str) -> None:
        if self._steps or self._held:
            self._emit(out, perf_counter_ns(), final=True, cpu_only=open_status == SpanStatus.TERMINATED)

    def _hold_tensors(self, span: Span, started: bool) -> bool:
        attrs = span.attrs
        metrics = span.metrics
        # Held without their autograd graphs; read with the interval's others.
        shadowed = metrics.keys() if metrics else ()
        if attrs:
            span.attrs = attrs = {k: detach(v) if is_tensor(v) else v for k, v in attrs.items()}
            for key, value in attrs.items():
                if is_tensor(value):
                    self._tensors.append((None if key in shadowed else _tensor_field(key), value))
        if metrics:
            span.metrics = metrics = {k: detach(v) if is_tensor(v) else v for k, v in metrics.items()}
            for key, value in metrics.items():
                if is_tensor(value):
                    self._tensors.append((_tensor_field(key), value))
        if span.level <= self._max_route_level:
            self._held.append((span, started))
        return True

    def _iteration(self, span: Span, out: Out) -> None:
        t0 = span.t0
        t1 = span.t1 or t0
        if self._interval_start is None:
            self._interval_start = t0
        self._steps += 1
        self._sum += t1 - t0
        durations = self._durations
        durations.append(t1 - t0)
        if len(durations) >= _BATCH:
            self._hist.add_many(durations)
            durations.clear()
        self._last_t1 = t1
        self.loop_ended = False
        parent = span.parent
        if parent is not None and parent.name == SpanName.TRAINING_LOOP:
            self._loop_id = parent.id
        self._ident = span.tid
        if span.status in _FAILED:
            # An exception left the step: timed, but not completed and nothing consumed.
            self.failed_steps += 1
            if self._steps >= self.log_interval:
                self._emit(out, t1, final=False)
            return
        self.completed_steps += 1
        self.last_progress = max(self.last_progress, t1)

        step = batch = tokens = flops = None
        bad: list[tuple[str, float]] | None = None
        sums = self._metric_sum
        counts = self._metric_count
        attrs = span.attrs
        metrics = span.metrics
        shadow = metrics if attrs and metrics else None
        for values in (attrs, metrics):
            if not values:
                continue
            for key, value in values.items():
                if key in RESERVED:
                    if key in _STEP_KEYS:
                        step = value
                    elif key == "batch_size":
                        batch = value
                    elif key == "tokens":
                        tokens = value
                    elif key == "flops":
                        flops = value
                    elif key == "skipped" and value:
                        self.skipped_steps += 1
                    continue
                if shadow is not None and values is attrs and key in shadow:
                    continue
                kind = type(value)
                if kind is float:
                    if value - value:  # NaN or infinite: a finite value minus itself is 0.0
                        bad = [*(bad or ()), (key, value)]
                    sums[key] = sums.get(key, 0.0) + value
                    counts[key] = counts.get(key, 0) + 1
                elif kind is int or kind is str or kind is bool:
                    self._metric_last[key] = value
        self.last_step = step if type(step) is int else self.completed_steps
        if bad is not None:
            self._not_finite(span, bad, self.last_step, out)
        self._consumed_at(t0, batch, tokens, flops)
        if self._steps >= self.log_interval:
            self._emit(out, t1, final=False)

    def _consumed_at(self, t0: int, batch: Any, tokens: Any, flops: Any) -> None:
        """A completed step's own samples, tokens and FLOPs; ``step_info`` at ``t0`` for any not given (None)."""
        if batch is None or tokens is None or flops is None:
            info = self._info_at(t0) if self.step_info else {}
            if batch is None:
                batch = info.get("batch_size")
            if tokens is None:
                tokens = info.get("tokens")
            if flops is None:
                flops = info.get("flops")
        self._consumed(batch, tokens, flops)

    def _consumed(self, batch: Any, tokens: Any, flops: Any) -> None:
        """A completed step's samples, tokens and FLOPs, as given (ignored unless numbers)."""
        kind = type(batch)
        if kind is int or kind is float:
            self._samples += int(batch)
            self.consumed_samples += int(batch)
            self._samples_known = True
        kind = type(tokens)
        if kind is int or kind is float:
            self._tokens += int(tokens)
            self.consumed_tokens += int(tokens)
            self._tokens_known = True
        kind = type(flops)
        if kind is int or kind is float:
            self._flops += flops
        else:
            self._flops_known = False

    def native_state(self) -> tuple[Any, ...]:
        """The interval's sums as the native encoder updates them (``_encode.Encoder.convert``)."""
        return (
            PHASE_FIELDS,
            self._phase_sum,
            self._phase_count,
            self._metric_sum,
            self._metric_count,
            self._metric_last,
            self._hist._buckets,
            self._hist._inv_log,
        )

    def absorb(self, batch: tuple[Any, ...], out: Out) -> None:
        """Iterations the native encoder counted (``_encode.Encoder.take_iterations``), as ``_iteration`` would.

        Each was a completed step with plain values; ``consumed`` holds the samples, tokens and
        FLOPs of those that gave any (the others' come from ``step_info``).
        The last may complete the interval (when its record was already written whole; one
        whose start alone is written comes through ``span_ended``, its event going before its
        end record): its event is added here. The encoder already added their metrics and
        histogram buckets (``native_state``).
        """
        n, total, low, high, t0s, first_t0, last_t1, max_t1, last_step, loop_id, ident, consumed = batch
        if self._interval_start is None:
            self._interval_start = first_t0
        self._steps += n
        self._sum += total
        hist = self._hist
        hist.count += n
        hist.min = min(hist.min, low)
        hist.max = max(hist.max, high)
        self._last_t1 = last_t1
        self.last_progress = max(self.last_progress, max_t1)
        self.loop_ended = False
        if loop_id is not None:
            self._loop_id = loop_id
        self._ident = ident
        self.completed_steps += n
        self.last_step = last_step if type(last_step) is int else self.completed_steps
        plain = n
        if consumed is not None:
            # Steps that gave batch_size, tokens or flops: (t0, batch, tokens, flops), None where not given.
            plain -= len(consumed)
            for row in consumed:
                self._consumed_at(*row)
        if plain and not self.step_info:
            self._flops_known = False  # no flops given: as _consumed(None, None, None)
        elif plain:
            for t0 in t0s if t0s is not None else [first_t0] * plain:
                info = self._info_at(t0)
                self._consumed(info.get("batch_size"), info.get("tokens"), info.get("flops"))
        if self._steps >= self.log_interval:
            self._emit(out, last_t1, final=False)

    def _add_count(self, key: str, value: int) -> None:
        if key == "tokens":
            self._tokens += value
            self.consumed_tokens += value
            self._tokens_known = True
        else:
            self._samples += value
            self.consumed_samples += value
            self._samples_known = True

    def flushing(self, out: Out) -> None:
        """``flush()`` was called: write the held records now (one read of their tensors)."""
        if self._held and not self.quiet_flush:
            self._release_held(out, cpu_only=False)

    def _release_held(self, out: Out, *, cpu_only: bool) -> None:
        """Read the held tensors together, count them, and write the held records."""
        tensors = self._tensors
        resolved: dict[int, Any] = {}
        if tensors:
            numbers = resolve_tensors([t for _, t in tensors], cpu_only=cpu_only)
            for (key, tensor), number in zip(tensors, numbers, strict=False):
                resolved[id(tensor)] = number
                value = _number(number)
                if key is None or value is None:
                    continue
                if key in _COUNTED:
                    self._add_count(key, int(value))
                elif key not in RESERVED:
                    self._metric_sum[key] = self._metric_sum.get(key, 0.0) + value
                    self._metric_count[key] = self._metric_count.get(key, 0) + 1
        for span, started in self._held:
            bad: list[tuple[str, float]] = []
            for holder in ("attrs", "metrics"):
                values = getattr(span, holder)
                if values:
                    values = {k: resolved.get(id(v), v) if is_tensor(v) else v for k, v in values.items()}
                    setattr(span, holder, values)
                    bad += [(k, v) for k, v in values.items() if type(v) is float and v - v and k not in RESERVED]
            if bad:
                step = next((d[k] for d in (span.metrics or {}, span.attrs or {}) for k in _STEP_KEYS if k in d), None)
                self._not_finite(span, bad, step, out)
            self.pipeline.release_span(span, started, out)
        self._tensors = []
        self._held = []

    def _not_finite(self, span: Span, values: list[tuple[str, float]], step: Any, out: Out) -> None:
        """The first NaN or infinite value of each float metric: an event, once per metric (docs/format.md).

        A loss that stops being finite is where a diverged run began; the analysis names the rank and step
        where it happened first (docs/analysis.md).
        """
        for key, value in values:
            if key in self.non_finite or len(self.non_finite) >= _MAX_NON_FINITE:
                continue
            self.non_finite.add(key)
            attrs: dict[str, Any] = {"metric": key, "value": value}
            if type(step) is int:
                attrs["step"] = step
            self.pipeline.emit_event(
                EventName.NON_FINITE_METRIC,
                attrs,
                out,
                span_id=span.id,
                ident=span.tid,
                mono=span.t1 or span.t0,
                level=int(Verbosity.INFO),
            )

    def _quantiles(self, hist: LogHistogram) -> list[float]:
        """The interval's p50, p90 and p99, with the buckets the native encoder counted for it."""
        if self.native_quantiles is not None:
            found: list[float] | None = self.native_quantiles(
                hist._buckets, _QUANTILES, hist.count, hist.gamma, hist.min, hist.max
            )
            if found is not None:
                return found
        return hist.quantiles(_QUANTILES)

    def _emit(self, out: Out, now: int, *, final: bool, cpu_only: bool = False) -> None:
        pipeline = self.pipeline
        steps = self._steps
        attrs: dict[str, Any] = {"interval": steps}
        if self.last_step is not None:
            attrs["current_iteration"] = self.last_step
        info = self.step_info[-1][1] if self.step_info else {}
        if info.get("num_iterations") is not None:
            attrs["num_iterations"] = info["num_iterations"]

        if self._held or self._tensors:
            self._release_held(out, cpu_only=cpu_only)
        if steps:
            seconds = 1e-9
            if self._durations:
                self._hist.add_many(self._durations)
                self._durations.clear()
            attrs["average_iteration_time"] = self._sum / steps * seconds
            attrs["iteration_time_min"] = self._hist.min * seconds
            attrs["iteration_time_max"] = self._hist.max * seconds
            p50, p90, p99 = self._quantiles(self._hist)
            attrs["iteration_time_p50"] = p50 * seconds
            attrs["iteration_time_p90"] = p90 * seconds
            attrs["iteration_time_p99"] = p99 * seconds
            for field, total in self._phase_sum.items():
                attrs[field] = total / self._phase_count[field] * seconds
            for field, total in self._device_sum.items():
                attrs[field] = total / self._device_count[field] * seconds
            start = self._interval_start if self._interval_start is not None else now
            end = self._last_t1 or now
            elapsed = max(end - start, 1)
            excluded: dict[str, int] = {}
            keep: list[tuple[int, int, str]] = []
            for t0, t1, field in self._windows:
                inside = min(t1, end) - max(t0, start)
                if inside > 0:
                    excluded[field] = excluded.get(field, 0) + inside
                if t1 > end:
                    keep.append((max(t0, end), t1, field))
            self._windows = keep
            productive = max(elapsed - sum(excluded.values()), 1)
            attrs["elapsed_time"] = elapsed * seconds
            attrs["checkpoint_time"] = excluded.get("checkpoint_time", 0) * seconds
            attrs["validation_time"] = excluded.get("validation_time", 0) * seconds
            per_second = 1e9 / productive
            attrs["iterations_per_second"] = steps * per_second
            if self._samples_known:
                attrs["batch_size"] = self._samples / steps
                attrs["samples_per_second"] = self._samples * per_second
            if self._tokens_known:
                attrs["tokens_per_second"] = self._tokens * per_second
            if self._flops_known and self._flops > 0:
                tflops = self._flops * per_second / 1e12
                attrs["tflops"] = tflops
                peak = info.get("peak_tflops") or self.peak_tflops or peak_for(self.device_name)
                if peak:
                    attrs["mfu"] = tflops / peak
            self._interval_start = end
        for key, metric_sum in self._metric_sum.items():
            attrs.setdefault(key, metric_sum / self._metric_count[key])  # measured fields win
        for key, value in self._metric_last.items():
            attrs.setdefault(key, value)
        attrs.update(self.snapshot())
        if final:
            attrs["final"] = True
        self._reset_interval()
        pipeline.emit_event(
            EventName.TRAINING_ITERATIONS,
            attrs,
            out,
            span_id=self._loop_id,
            ident=self._ident,
            mono=now,
            level=int(Verbosity.INFO),
        )

    def _checkpoint_details(self, span: Span) -> None:
        attrs = span.attrs or {}
        metrics = span.metrics or {}
        values: dict[str, Any] = {**attrs, **metrics}
        link = span.link
        added: dict[str, Any] = {}
        if span.name == SpanName.CHECKPOINT_SAVE_FINALIZATION and isinstance(link, Span):
            linked = {**(link.attrs or {}), **(link.metrics or {})}
            for key in (
                "checkpoint_path",
                "path",
                "checkpoint_directory",
                "checkpoint_filename",
                "checkpoint_type",
                "current_iteration",
                "step",
            ):
                if key in linked and key not in values:
                    values[key] = linked[key]
                    added[key] = linked[key]
            if link.t1 is not None:
                added["blocking_time"] = (link.t1 - link.t0) * 1e-9
            if span.t1 is not None:
                added["total_time"] = (span.t1 - link.t0) * 1e-9
        if span.status == SpanStatus.OK and values.get("checkpoint_size") is None:
            path = checkpoint_path(values)
            if path is not None:
                size = measure_size(path)
                if size is not None:
                    added["checkpoint_size"] = size
                    if values.get("checkpoint_directory") is None:
                        added["checkpoint_directory"] = str(Path(path).parent)
                    if values.get("checkpoint_filename") is None:
                        added["checkpoint_filename"] = Path(path).name
        elif span.status == SpanStatus.ERROR:
            # A save that failed: the space left where it wrote tells a full disk from other faults (PyTorch's
            # zip writer then says only "unexpected pos ...").
            path = checkpoint_path(values)
            space = file_system_space(path) if path is not None else None
            if space is not None:
                added["fs_free_bytes"], added["fs_total_bytes"] = space
        if added:
            span.metrics = {**metrics, **added}

    def _resumed(self, span: Span) -> None:
        values = {**(span.attrs or {}), **(span.metrics or {})}
        if span.status != SpanStatus.OK:
            return
        step = None
        for key in _STEP_KEYS:
            step = values.get(key)
            if step is not None:
                break
        if type(step) is not int:
            return
        self.last_step = step
        completed = values.get("completed_steps", step)
        self.completed_steps = int(completed) if type(completed) is int else step
        for key in ("consumed_samples", "consumed_tokens", "skipped_steps"):
            value = values.get(key)
            if type(value) is int:
                setattr(self, key, value)
            elif key == "consumed_samples":
                batch = self._info_at(span.t0).get("batch_size")
                if type(batch) is int:
                    self.consumed_samples = self.completed_steps * batch
