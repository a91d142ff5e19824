"""NVTX ranges for Nsight Systems: pushed and popped on the caller's thread (extra ``nvtx``)."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from .._config import BackendConfig, ConfigError
from .._names import RecordKind, SpanName, Verbosity
from ._base import Record

if TYPE_CHECKING:
    from .._config import Config
    from .._identity import Identity
    from ._base import Backend

#: Colours (0xRRGGBB) of the standard phases; other names get a stable colour from a palette.
PHASE_COLORS: dict[str, int] = {
    SpanName.APPLICATION: 0x808080,
    SpanName.TRAINING_LOOP: 0x4C72B0,
    SpanName.ITERATION: 0x76B900,
    SpanName.DATA_LOADING: 0xFFD700,
    SpanName.FORWARD: 0x1F77B4,
    SpanName.BACKWARD: 0x9467BD,
    SpanName.ZERO_GRAD: 0x8C564B,
    SpanName.OPTIMIZER_STEP: 0xFF7F0E,
    SpanName.VALIDATION: 0x17BECF,
    SpanName.TEST: 0x17BECF,
    SpanName.CHECKPOINT_SAVE_SYNC: 0xD62728,
    SpanName.CHECKPOINT_SAVE_ASYNC: 0xE377C2,
    SpanName.CHECKPOINT_SAVE_FINALIZATION: 0xE377C2,
    SpanName.CHECKPOINT_LOAD: 0xBCBD22,
    SpanName.DISTRIBUTED_INIT: 0x7F7F7F,
    SpanName.MODEL_INIT: 0x7F7F7F,
    SpanName.OPTIMIZER_INIT: 0x7F7F7F,
    SpanName.DATA_LOADER_INIT: 0x7F7F7F,
}
_PALETTE = (0x2CA02C, 0x98DF8A, 0xAEC7E8, 0xFFBB78, 0xC5B0D5, 0xC49C94, 0xF7B6D2, 0xDBDB8D, 0x9EDAE5)
ERROR_COLOR = 0xFF0000
EVENT_COLOR = 0xFFFFFF
_MAX_CACHED = 4096


def color_for(name: str) -> int:
    """The colour of a range named ``name``."""
    color = PHASE_COLORS.get(name)
    if color is None:
        color = _PALETTE[zlib.crc32(name.encode("utf-8", "replace")) % len(_PALETTE)]
    return color


@dataclass
class NvtxBackendConfig(BackendConfig):
    """NVTX ranges per span in domain ``domain``; events and errors as marks.

    ``payload``: the span attribute whose integer value is the range's payload
    (the iteration number by default). ``colors`` overrides phase colours
    (name -> 0xRRGGBB).
    """

    type: ClassVar[str] = "nvtx"
    verbosity: Verbosity | str | int = Verbosity.PROFILING
    domain: str = "traintrace"
    payload: str = "step"
    marks: bool = True
    colors: dict[str, int] = field(default_factory=dict)

    def validate(self, where: str) -> None:
        super().validate(where)
        if not isinstance(self.domain, str) or not self.domain:
            raise ConfigError(f"{where}.domain: expected a non-empty domain name")
        if not isinstance(self.payload, str):
            raise ConfigError(f"{where}.payload: expected an attribute name")
        if not isinstance(self.marks, bool):
            raise ConfigError(f"{where}.marks: expected true or false")
        if not isinstance(self.colors, Mapping) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in self.colors.values()
        ):
            raise ConfigError(f"{where}.colors: expected a table of name = 0xRRGGBB")

    def create(self, config: Config, identity: Identity, level: int) -> Backend:
        return NvtxBackend(
            domain=self.domain, verbosity=level, payload=self.payload, marks=self.marks, colors=self.colors
        )


def _nop(span: Any) -> None:
    return None


class NvtxBackend:
    """A span listener: ``span_started`` pushes an NVTX range, ``span_stopped`` pops it.

    Both run on the caller's thread, so ranges nest as the code does and
    Nsight shows them on the thread that ran them. A stack of ranges is kept
    per thread: a span stopped on another thread (``stop()`` from a callback)
    has its range popped by its own thread at that thread's next start or
    stop (counted in ``unbalanced``), so later pops close their own ranges. Range names are the span
    names (no counters), registered once per name in the domain; the
    iteration number goes in the payload. With no profiler attached, NVTX
    hands out a dummy domain and both methods become a bare call that returns.

    Events and errors arrive as records on the writer thread and become marks
    there (on the writer's row, timestamped when written: up to
    ``flush_interval`` late).
    """

    def __init__(
        self,
        domain: str = "traintrace",
        *,
        verbosity: int = Verbosity.PROFILING,
        payload: str = "step",
        marks: bool = True,
        colors: Mapping[str, int] | None = None,
    ) -> None:
        try:
            import nvtx
        except ImportError:
            raise ConfigError("backends.nvtx: needs the nvtx package: pip install 'traintrace[nvtx]'") from None
        self.verbosity = int(verbosity)
        self._payload_key = payload
        self._marks = marks
        self._colors = dict(colors or {})
        self._domain = nvtx.get_domain(domain)
        self.enabled = type(self._domain).__name__ != "DummyDomain"
        self._plain: dict[str, Any] = {}
        self._with_payload: dict[str, Any] = {}
        self._mark_attrs: dict[tuple[str, str], Any] = {}
        self._get_ident = threading.get_ident
        #: per thread (ident): the ids of the spans whose ranges it pushed, innermost last
        self._stacks: dict[int, list[int]] = {}
        #: spans stopped on a thread other than the one that pushed their range
        self._stopped_elsewhere: set[int] = set()
        self.unbalanced = 0
        if self.enabled:
            self._push = self._domain.push_range
            self._pop = self._domain.pop_range
        else:
            # No tool attached: nothing to tell anyone, at the cost of one call.
            self.span_started = _nop  # type: ignore[method-assign]
            self.span_stopped = _nop  # type: ignore[method-assign]

    # -- listener (caller's thread) ----------------------------------------
    def span_started(self, span: Any) -> None:
        if span.level > self.verbosity:
            return
        try:
            name = span.name
            attrs = span.attrs
            step = attrs.get(self._payload_key) if attrs else None
            if type(step) is int:
                event = self._with_payload.get(name) or self._new(name, True)
                event.payload = step
            else:
                event = self._plain.get(name) or self._new(name, False)
            stack = self._stacks.get(span.tid)
            if stack is None:
                stack = self._stacks[span.tid] = []
            elif self._stopped_elsewhere and stack:
                self._pop_stopped(stack)
            self._push(event)
            stack.append(span.id)
        except Exception:  # noqa: BLE001 - a listener must never raise into training
            self.span_started = _nop  # type: ignore[method-assign]
            self.span_stopped = _nop  # type: ignore[method-assign]

    def span_stopped(self, span: Any) -> None:
        if span.level > self.verbosity:
            return
        stack = self._stacks.get(span.tid)
        if not stack:
            return
        if span.tid != self._get_ident():
            # NVTX push/pop ranges belong to a thread: another thread cannot pop this one.
            # Its range is popped by its own thread at that thread's next start or stop.
            self.unbalanced += 1
            self._stopped_elsewhere.add(span.id)
            return
        try:
            span_id = span.id
            if stack[-1] == span_id:
                stack.pop()
                self._pop()
                if self._stopped_elsewhere:
                    self._pop_stopped(stack)
            elif span_id in stack:
                # Ranges above it belong to spans stopped elsewhere (or out of order): pop them too.
                while stack:
                    top = stack.pop()
                    self._pop()
                    self._stopped_elsewhere.discard(top)
                    if top == span_id:
                        break
        except Exception:  # noqa: BLE001
            pass

    def _pop_stopped(self, stack: list[int]) -> None:
        """Pop (on their own thread) the ranges of spans that another thread stopped."""
        stopped = self._stopped_elsewhere
        while stack and stack[-1] in stopped:
            stopped.discard(stack.pop())
            self._pop()

    def _new(self, name: str, with_payload: bool) -> Any:
        cache = self._with_payload if with_payload else self._plain
        color = self._colors.get(name, color_for(name))
        event = self._domain.get_event_attributes(message=name, color=color)
        if len(cache) < _MAX_CACHED:
            cache[name] = event
        return event

    # -- backend (writer thread) -------------------------------------------
    def open(self, header: Record) -> None:
        return None

    def write(self, records: Sequence[Record]) -> None:
        if not self.enabled or not self._marks:
            return
        for record in records:
            kind = record.get("kind")
            if kind == RecordKind.EVENT:
                self._mark(kind, str(record.get("name", "")), EVENT_COLOR)
            elif kind == RecordKind.ERROR:
                label = str(record.get("error_type") or record.get("name", "error"))
                self._mark(kind, label, ERROR_COLOR)

    def _mark(self, kind: str, label: str, color: int) -> None:
        key = (kind, label)
        event = self._mark_attrs.get(key)
        if event is None:
            event = self._domain.get_event_attributes(message=f"{kind}: {label}", color=color)
            if len(self._mark_attrs) < _MAX_CACHED:
                self._mark_attrs[key] = event
        self._domain.mark(event)

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None
