"""Device (GPU) time of spans from CUDA events, resolved on the writer thread without a synchronize.

On a GPU, ``forward`` returns as soon as its kernels are queued: its CPU
duration is launch time. :class:`DeviceTimer` records a CUDA event on the
current stream when a timed span starts and another when it stops (a span
listener, on the caller's thread, like the NVTX backend), taking both from a
pool made ahead of time. On the writer thread it is also a span observer: it
holds the span's record until both events have completed (``event.query()``,
which never waits), then releases it with ``gpu_dur`` (nanoseconds between
the two events on the device) and ``gpu_idle`` (nanoseconds between the end
of the previous timed phase on the same stream and this one's start) next to
``dur``. A span whose events do not complete within ``device_timing_timeout``
is written without them and counted; at close the wait is cut to the close
budget. See docs/configuration.md ("Device timing") and docs/format.md.

Nothing here imports torch: the torch device is built only when torch is
already imported and CUDA already initialised (``auto``), or when
``device_timing = true`` asks for it.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Final, Protocol

from ._names import EventName, SpanName, Verbosity

if TYPE_CHECKING:
    from ._config import Config
    from ._pipeline import Pipeline
    from ._recorder import Span

log = logging.getLogger("traintrace.lib")

Out = list[tuple[int, dict[str, Any]]]

#: The phases timed on the device unless ``device_timing_phases`` says otherwise.
DEFAULT_PHASES: Final[tuple[str, ...]] = (
    SpanName.ITERATION,
    SpanName.DATA_LOADING,
    SpanName.FORWARD,
    SpanName.BACKWARD,
    SpanName.ZERO_GRAD,
    SpanName.OPTIMIZER_STEP,
    SpanName.COLLECTIVE,
)
#: Spans that contain other timed phases: no idle gap is measured around them.
CONTAINERS: Final = frozenset({SpanName.ITERATION, SpanName.TRAINING_LOOP, SpanName.APPLICATION})
#: Event pairs made when the pool starts, and the most that may exist at once.
POOL_START: Final = 1024
POOL_MAX: Final = 16384
#: Seconds between two resolution passes on the writer thread (each costs a query per pending span).
_RESOLVE_EVERY: Final = 0.005
#: Sleep between polls while close waits for the last events.
_CLOSE_POLL: Final = 0.001


class Event(Protocol):
    """What a device event offers (``torch.cuda.Event`` does)."""

    def record(self, stream: Any = ...) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> float: ...


class Device(Protocol):
    """Where events come from: the current stream of the calling thread, and new events."""

    def current(self) -> tuple[int, Any]:
        """``(key, stream)``: a number naming the calling thread's current stream, and the stream."""
        ...

    def new_event(self) -> Event:
        """A new timing event (made on the writer thread or at the first timed span)."""
        ...


def cuda_initialized() -> bool:
    """True when torch is already imported and has initialised CUDA in this process (imports nothing)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    cuda = getattr(torch, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a broken torch: no device timing
        return False


class TorchDevice:
    """CUDA streams and events through torch, on the device current when it was made."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self.index = torch.cuda.current_device()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        get_device = getattr(torch._C, "_cuda_getDevice", None)
        self._raw = raw
        self._get_device = get_device
        self._capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
        self._streams: dict[int, Any] = {}

    def current(self) -> tuple[int, Any]:
        if self._capturing is not None and self._capturing():
            raise _Capturing
        if self._raw is not None and self._get_device is not None:
            index = self._get_device()
            if index != self.index:
                raise _OtherDevice
            key = int(self._raw(index))
            stream = self._streams.get(key)
            if stream is None:
                stream = self._torch.cuda.current_stream(index)
                if len(self._streams) < 64:
                    self._streams[key] = stream
            return key, stream
        stream = self._torch.cuda.current_stream()
        if stream.device_index != self.index:
            raise _OtherDevice
        return int(stream.cuda_stream), stream

    def new_event(self) -> Event:
        torch = self._torch
        with torch.cuda.device(self.index):
            event = torch.cuda.Event(enable_timing=True)
            # Record once here so the CUDA event exists before a training thread records it.
            event.record(torch.cuda.current_stream(self.index))
        return event  # type: ignore[no-any-return]


class _OtherDevice(Exception):
    """The calling thread's current device is not the one the pool's events belong to."""


class _Capturing(Exception):
    """The calling thread's stream is capturing a CUDA graph: its phases are not timed."""


#: Tests replace this with a factory of a fake device (a unit test of this module's logic).
device_factory: Callable[[], Device] | None = None


def wanted(config: Config) -> bool:
    """Whether this configuration times spans on the device (``auto``: CUDA already initialised)."""
    setting = config.device_timing
    if setting is False or setting == "off":
        return False
    if device_factory is not None:
        return True
    if setting == "auto":
        return cuda_initialized()
    return True


def check(config: Config) -> None:
    """Raise ConfigError when ``device_timing = true`` cannot work here (no torch, no CUDA device)."""
    from ._config import ConfigError

    if config.device_timing is not True or device_factory is not None:
        return
    try:
        import torch
    except ImportError:
        raise ConfigError("device_timing: true needs torch with CUDA: pip install 'traintrace[torch]'") from None
    if not torch.cuda.is_available():
        raise ConfigError("device_timing: true needs a CUDA device, and torch sees none (set it to 'auto' or false)")


class DeviceTimer:
    """Span listener (caller's thread) and span observer (writer thread) for device time."""

    def __init__(
        self,
        pipeline: Pipeline,
        device: Device | Callable[[], Device],
        *,
        phases: Iterable[str] = DEFAULT_PHASES,
        timeout: float = 10.0,
        pool_start: int = POOL_START,
        pool_max: int = POOL_MAX,
    ) -> None:
        self.pipeline = pipeline
        #: the device, or a callable that makes it at the first timed span (on the training thread)
        self._device: Device | None = None
        self._make: Callable[[], Device] | None = None
        if callable(device) and not hasattr(device, "current"):
            self._make = device
        else:
            self._device = device  # type: ignore[assignment]
        self.phases = frozenset(phases)
        self.timeout = float(timeout)
        self._pool_start = pool_start
        self._pool_max = max(pool_max, pool_start)
        #: free (start, end) event pairs; taken on the training thread, returned on the writer's
        self._free: list[tuple[Event, Event]] = []
        self._made = 0
        #: span id -> (pair, stream key): started, not stopped (training thread writes, writer reads)
        self._open: dict[int, tuple[tuple[Event, Event], int]] = {}
        #: span id -> (pair, start key, end key, order of the end record): both events recorded
        self._recorded: dict[int, tuple[tuple[Event, Event], int, int, int]] = {}
        self._order = itertools.count()
        #: writer thread: held spans waiting for their events, in the order they were held
        self._waiting: deque[tuple[Span, bool, tuple[Event, Event], int, int, int, float]] = deque()
        #: writer thread: per stream key, the end event of the latest resolved phase and its CPU end
        self._last_end: dict[int, tuple[tuple[Event, Event], int]] = {}
        self._last_pass = 0.0
        self.disabled = False
        #: the statistics told each resolved device time (``_stats.IterationStats.device_time``)
        self.statistics: Any = None
        # counts
        self.timed = 0
        self.abandoned = 0
        self.pool_empty = 0
        self.other_device = 0
        self.capturing = 0
        self.unpaired = 0
        self.failures = 0
        self._warned_abandoned = False
        if self._device is not None:
            self._fill(self._device, pool_start)

    # -- listener (caller's thread) ----------------------------------------
    def span_started(self, span: Span) -> None:
        try:
            if span.name not in self.phases or self.disabled:
                return
        except TypeError:  # an unhashable name: not a phase
            return
        try:
            device = self._device
            if device is None:
                device = self._start_device()
                if device is None:  # another thread is making the pool: this span is not timed
                    return
            key, stream = device.current()
            free = self._free
            if not free:
                self.pool_empty += 1
                return
            pair = free.pop()
            pair[0].record(stream)
            self._open[span.id] = (pair, key)
        except _OtherDevice:
            self.other_device += 1
        except _Capturing:
            self.capturing += 1
        except Exception:  # noqa: BLE001 - a listener must never raise into training
            self._failed()

    def span_stopped(self, span: Span) -> None:
        if not self._open:
            return
        entry = self._open.pop(span.id, None)
        if entry is None:
            return
        pair, key0 = entry
        try:
            key, stream = self._device.current()  # type: ignore[union-attr]
            pair[1].record(stream)
            self._recorded[span.id] = (pair, key0, key, next(self._order))
        except _OtherDevice:
            self.other_device += 1
            self._free.append(pair)
        except _Capturing:
            self.capturing += 1
            self._free.append(pair)
        except Exception:  # noqa: BLE001
            self._failed()

    def _start_device(self) -> Device | None:
        """The first timed span: make the device (on the training thread, whose device it is) and the pool."""
        make, self._make = self._make, None
        if make is None:
            return None
        device = make()
        self._fill(device, self._pool_start)
        self._device = device
        return device

    def _fill(self, device: Device, count: int) -> None:
        free = self._free
        for _ in range(count):
            if self._made >= self._pool_max:
                return
            free.append((device.new_event(), device.new_event()))
            self._made += 1

    def _failed(self) -> None:
        self.failures += 1
        if not self.disabled:
            self.disabled = True
            log.warning("traintrace: device timing failed; spans are timed on the CPU only from now on", exc_info=True)

    # -- observer (writer thread) ------------------------------------------
    def hold(self, span: Span, started: bool) -> bool:
        """Keep an ended span's record back until its device time is known."""
        entry = self._recorded.pop(span.id, None) if self._recorded else None
        if entry is None:
            if self._open:
                # Ended without an end event (its stop failed to record, or the writer saw the span between
                # the stop's clock reading and the listener): written without device time; the pair is reused.
                unpaired = self._open.pop(span.id, None)
                if unpaired is not None:
                    self.unpaired += 1
                    self._free.append(unpaired[0])
            return False
        pair, key0, key1, order = entry
        self._waiting.append((span, started, pair, key0, key1, order, time.monotonic()))
        return True

    def span_ended(self, span: Span, out: Out) -> None:
        if not self._waiting:
            return
        now = time.monotonic()
        if now - self._last_pass >= _RESOLVE_EVERY:
            self._last_pass = now
            self.resolve(out, now)

    def flushing(self, out: Out) -> None:
        if self._waiting:
            self.resolve(out, time.monotonic())

    def finish(self, out: Out, open_status: str) -> None:
        """Close: wait for pending events (non-blocking polls) within the timeout and the close budget."""
        deadline = time.monotonic() + self.timeout
        close_by = getattr(self.pipeline, "_deadline", None)
        if close_by is not None:
            # Leave the rest of the budget to the other observers, the close record and the backends.
            left = close_by - time.monotonic()
            deadline = min(deadline, time.monotonic() + max(left, 0.0) / 2)
        while self._waiting:
            now = time.monotonic()
            self.resolve(out, now, give_up=now >= deadline)
            if not self._waiting:
                break
            time.sleep(_CLOSE_POLL)
        self._open.clear()
        self._recorded.clear()
        counts = (self.abandoned, self.pool_empty, self.other_device, self.capturing, self.unpaired, self.failures)
        if self.timed or any(counts):
            attrs: dict[str, Any] = {"timed": self.timed, "abandoned": self.abandoned}
            if self.pool_empty:
                attrs["pool_empty"] = self.pool_empty
            if self.other_device:
                attrs["other_device"] = self.other_device
            if self.capturing:
                attrs["capturing"] = self.capturing
            if self.unpaired:
                attrs["unpaired"] = self.unpaired
            if self.failures:
                attrs["failures"] = self.failures
            self.pipeline.emit_event(
                EventName.DEVICE_TIMING,
                attrs,
                out,
                span_id=0,
                ident=0,
                mono=time.perf_counter_ns(),
                level=int(Verbosity.INFO),
            )

    def resolve(self, out: Out, now: float, give_up: bool = False) -> None:
        """Release the held spans whose events completed, in order; abandon those waiting too long."""
        waiting = self._waiting
        keep: deque[tuple[Span, bool, tuple[Event, Event], int, int, int, float]] = deque()
        #: per stream, the earliest end event not reached yet: later ones on that stream are not either
        blocked: dict[int, int] = {}
        for entry in waiting:
            span, started, pair, key0, key1, order, since = entry
            first = blocked.get(key1)
            done: bool | None = False
            if first is None or order < first:
                try:
                    done = bool(pair[1].query())
                except Exception:  # noqa: BLE001 - a failed event: written without device time
                    done = None
            if done is False and not give_up and now - since < self.timeout:
                blocked[key1] = order if first is None else min(first, order)
                keep.append(entry)
                continue
            extra: dict[str, Any] | None = None
            if done:
                try:
                    extra = self._measure(span, pair, key0, key1)
                except Exception:  # noqa: BLE001
                    extra = None
            if extra is None:
                self.abandoned += 1
                if not self._warned_abandoned:
                    self._warned_abandoned = True
                    log.warning(
                        "traintrace: device events of span %r did not complete within %.1fs; written without "
                        "device time (counted in the 'device_timing' event at close)",
                        span.name,
                        min(self.timeout, max(now - since, 0.0)),
                    )
            else:
                self.timed += 1
                if self.statistics is not None:
                    try:
                        self.statistics.device_time(span.name, extra["gpu_dur"])
                    except Exception:
                        log.exception("traintrace: statistics failed on a device time")
            try:
                self.pipeline.release_span(span, started, out, extra)
            except Exception:
                log.exception("traintrace: a held span could not be written")
        self._waiting = keep
        self._refill()

    def _measure(self, span: Span, pair: tuple[Event, Event], key0: int, key1: int) -> dict[str, Any] | None:
        """``gpu_dur`` and ``gpu_idle`` of a span whose events completed; recycles its pair."""
        gpu_dur = round(pair[0].elapsed_time(pair[1]) * 1e6)
        extra: dict[str, Any] = {"gpu_dur": max(gpu_dur, 0)}
        if span.name in CONTAINERS:
            self._free.append(pair)
            return extra
        previous = self._last_end.get(key0)
        if previous is not None and key0 == key1 and previous[1] <= span.t0:
            idle = round(previous[0][1].elapsed_time(pair[0]) * 1e6)
            if idle >= 0:
                extra["gpu_idle"] = idle
        if key0 == key1 and (previous is None or previous[1] <= (span.t1 or span.t0)):
            # This phase's end event is the next one's reference: its pair is kept until then.
            self._last_end[key0] = (pair, span.t1 or span.t0)
            if previous is not None:
                self._free.append(previous[0])
        else:
            self._free.append(pair)
        return extra

    def _refill(self) -> None:
        """Top the pool up (writer thread) when the training thread took more than half of it."""
        device = self._device
        if device is None or self.disabled or len(self._free) >= self._pool_start // 2:
            return
        try:
            self._fill(device, self._pool_start)
        except Exception:  # noqa: BLE001
            self._failed()

    def stats(self) -> dict[str, int]:
        return {
            "timed": self.timed,
            "abandoned": self.abandoned,
            "pool_empty": self.pool_empty,
            "other_device": self.other_device,
            "capturing": self.capturing,
            "unpaired": self.unpaired,
            "failures": self.failures,
            "pending": len(self._waiting),
        }


def attach(recorder_listeners: list[Any], pipeline: Pipeline, config: Config) -> DeviceTimer | None:
    """A device timer for a new recorder when the configuration wants one (its listener is added first)."""
    if not pipeline.routes or not wanted(config):
        return None
    device: Callable[[], Device] = device_factory or _lazy_torch_device
    timer = DeviceTimer(pipeline, device, phases=config.device_timing_phases, timeout=config.device_timing_timeout)
    pipeline.observers.insert(0, timer)
    recorder_listeners.append(timer)
    return timer


def _lazy_torch_device() -> Device:
    return TorchDevice()
