"""Standard span and event names, record kinds and verbosity levels.

Names are plain strings: any string is a valid span or event name. The
constants below are the standard ones, spelled as the reference library
(``aidot-training-telemetry``) spells them so that dashboards and queries
written for it keep working.
"""

from __future__ import annotations

import enum
from typing import Final


class Verbosity(enum.IntEnum):
    """How detailed a record is. A backend receives records at or below its level."""

    ERROR = 0
    INFO = 1
    TRACING = 3
    PROFILING = 4

    @classmethod
    def parse(cls, value: object) -> Verbosity:
        """Accept a member, its name (any case) or its number."""
        if isinstance(value, Verbosity):
            return value
        if isinstance(value, bool):
            raise ValueError(f"not a verbosity: {value!r}")
        if isinstance(value, int):
            return cls(value)
        if isinstance(value, str):
            text = value.strip()
            if text.isdigit():
                return cls(int(text))
            try:
                return cls[text.upper()]
            except KeyError:
                pass
        choices = ", ".join(m.name.lower() for m in cls)
        raise ValueError(f"not a verbosity: {value!r} (choose one of {choices})")


class SpanName:
    """The standard span names."""

    APPLICATION: Final = "main_function"
    DISTRIBUTED_INIT: Final = "distributed_code_initialization"
    DATA_LOADER_INIT: Final = "data_loader_initialization"
    MODEL_INIT: Final = "model_initialization"
    OPTIMIZER_INIT: Final = "optimizer_initialization"
    TRAINING_LOOP: Final = "training_loop"
    ITERATION: Final = "iteration"
    DATA_LOADING: Final = "data_loading"
    FORWARD: Final = "model_forward"
    BACKWARD: Final = "model_backward"
    ZERO_GRAD: Final = "zero_grad"
    OPTIMIZER_STEP: Final = "optimizer_update"
    VALIDATION: Final = "validation_loop"
    TEST: Final = "test_loop"
    CHECKPOINT_SAVE_SYNC: Final = "checkpoint_save_sync"
    CHECKPOINT_SAVE_ASYNC: Final = "checkpoint_save_async"
    CHECKPOINT_SAVE_FINALIZATION: Final = "checkpoint_save_finalization"
    CHECKPOINT_LOAD: Final = "checkpoint_load"
    #: Communication between ranks (all-reduce, barrier, ...): time waiting for the others.
    COLLECTIVE: Final = "collective"


class EventName:
    """The standard event names."""

    TRAINING_ITERATIONS: Final = "training_iterations"
    DEVICE_PROPERTIES: Final = "device_properties"
    SPAN_ATTRIBUTES: Final = "span_attributes"
    SIGNAL: Final = "signal"
    #: ``sys.exit()`` leaving a span: ``exit_code`` (and ``message`` for a non-integer argument).
    SYSTEM_EXIT: Final = "system_exit"
    ERROR: Final = "error"
    EXCEPTION: Final = "exception"
    #: Error records of the hang watchdog (docs/insight.md): suspected, ended by a forced exit.
    HANG_SUSPECTED: Final = "hang_suspected"
    HANG_EXIT: Final = "hang_exit"
    #: The event when progress resumes after a suspected hang.
    HANG_RESOLVED: Final = "hang_resolved"
    #: The event when the process group's rank or world size differs from the configuration's.
    IDENTITY: Final = "identity"
    #: At close, when spans were timed on the device: how many were timed, abandoned, ... (docs/format.md).
    DEVICE_TIMING: Final = "device_timing"
    #: The first NaN or infinite value of an iteration's float metric (a loss) in the process, once per metric.
    NON_FINITE_METRIC: Final = "non_finite_metric"


class RecordKind:
    """The ``kind`` field of a record (see docs/format.md)."""

    HEADER: Final = "header"
    SPAN: Final = "span"
    START: Final = "start"
    END: Final = "end"
    EVENT: Final = "event"
    ERROR: Final = "error"
    DROPPED: Final = "dropped"
    THREAD: Final = "thread"
    CLOSE: Final = "close"


class SpanStatus:
    """How a span ended."""

    OK: Final = "ok"
    ERROR: Final = "error"
    TERMINATED: Final = "terminated"
    ABANDONED: Final = "abandoned"
    #: Ended because something else began before it completed, as the Lightning callback's live wait for a batch
    #: when a checkpoint save begins instead: the commands count its time as no part of that phase.
    INTERRUPTED: Final = "interrupted"


#: Default verbosity of each standard span; other spans default to INFO.
DEFAULT_SPAN_VERBOSITY: Final[dict[str, Verbosity]] = {
    SpanName.ITERATION: Verbosity.TRACING,
    SpanName.DATA_LOADING: Verbosity.PROFILING,
    SpanName.FORWARD: Verbosity.PROFILING,
    SpanName.BACKWARD: Verbosity.PROFILING,
    SpanName.ZERO_GRAD: Verbosity.PROFILING,
    SpanName.OPTIMIZER_STEP: Verbosity.PROFILING,
    SpanName.COLLECTIVE: Verbosity.PROFILING,
}


def level_of(name: str) -> int:
    """The default verbosity of a span named ``name`` (``info`` for names not listed above)."""
    try:
        return int(DEFAULT_SPAN_VERBOSITY.get(name, Verbosity.INFO))
    except TypeError:  # a name that is not hashable (a list): misuse, recorded at info
        return int(Verbosity.INFO)
