"""Console progress: one short line per ``log_interval`` steps, on rank 0, through ``logging``.

The line is built from the ``training_iterations`` event that the interval
statistics already emit (on the writer thread), so the training thread does
nothing more for it. See docs/integrations/console.md.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ._config import BackendConfig, ConfigError
from ._names import EventName, RecordKind, Verbosity

if TYPE_CHECKING:
    from ._config import Config
    from ._identity import Identity
    from .backends._base import Backend, Record

LOGGER = "traintrace.progress"
FORMAT = "%(asctime)s traintrace %(message)s"
DATE_FORMAT = "%H:%M:%S"


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


@dataclass
class ConsoleBackendConfig(BackendConfig):
    """The progress line. On by default when stderr is a terminal; rank 0 only.

    ``logger``: where the lines go. When neither it nor the root logger has a
    handler, a stderr handler with a compact format is added to it, so the
    lines show without any logging setup; with your own logging configured,
    they follow it.
    """

    type: ClassVar[str] = "console"
    enabled: bool = field(default_factory=_stderr_is_terminal)
    ranks: str | int | Sequence[int] = "0"
    logger: str = LOGGER

    def validate(self, where: str) -> None:
        super().validate(where)
        if not isinstance(self.logger, str) or not self.logger:
            raise ConfigError(f"{where}.logger: expected a logger name")

    def create(self, config: Config, identity: Identity, level: int) -> Backend:
        return ConsoleBackend(self.logger, verbosity=level)


# ---------------------------------------------------------------- numbers for people


def human(value: float, digits: int = 3) -> str:
    """``value`` with about ``digits`` significant digits: 0.00538, 12.3, 182, 15,234."""
    if not math.isfinite(value):
        return str(value)
    magnitude = abs(value)
    if magnitude >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    if magnitude == 0:
        return "0"
    text = f"{value:.{digits}g}"
    return text if "e" not in text else f"{value:.{digits - 1}e}"


def duration(seconds: float) -> str:
    """``seconds`` as 45s, 11m32s, 3h05m, 2d04h."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    total = round(seconds)
    if total < 60:
        return f"{total}s"
    minutes, secs = divmod(total, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def progress_line(attrs: Record) -> str | None:
    """The line for one ``training_iterations`` event's attributes; None when it has no steps."""
    step_time = _float(attrs.get("average_iteration_time"))
    if step_time is None:
        return None
    parts: list[str] = []
    step = attrs.get("current_iteration")
    total = attrs.get("num_iterations")
    if isinstance(step, int):
        parts.append(f"step {step:,}" + (f"/{total:,}" if isinstance(total, int) and total > 0 else ""))
    p90 = _float(attrs.get("iteration_time_p90"))
    timing = f"{human(step_time * 1e3)} ms/step"
    if p90 is not None:
        timing += f" (p90 {human(p90 * 1e3)})"
    parts.append(timing)
    tokens = _float(attrs.get("tokens_per_second"))
    samples = _float(attrs.get("samples_per_second"))
    if tokens is not None:
        parts.append(f"{human(tokens)} tokens/s")
    elif samples is not None:
        parts.append(f"{human(samples)} samples/s")
    mfu = _float(attrs.get("mfu"))
    if mfu is not None:
        parts.append(f"MFU {human(mfu * 100, 2)}%")
    loss = _float(attrs.get("loss"))
    if loss is not None:
        parts.append(f"loss {human(loss, 4)}")
    elapsed = _float(attrs.get("elapsed_time"))
    interval = attrs.get("interval")
    done = attrs.get("completed_steps")
    done = done if isinstance(done, int) else step
    if isinstance(done, int) and isinstance(total, int) and total > done and isinstance(interval, int) and interval:
        per_step = (elapsed if elapsed is not None else step_time * interval) / interval
        parts.append(f"ETA {duration((total - done) * per_step)}")
    return " | ".join(parts)


class ConsoleBackend:
    """Logs one progress line per ``training_iterations`` event (writer thread; a few microseconds)."""

    def __init__(self, logger: str | logging.Logger = LOGGER, *, verbosity: int = Verbosity.INFO) -> None:
        self.logger = logging.getLogger(logger) if isinstance(logger, str) else logger
        self.verbosity = int(verbosity)
        self._handler: logging.Handler | None = None

    def open(self, header: Record) -> None:
        logger = self.logger
        if not logger.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
            logger.addHandler(handler)
            logger.propagate = False
            self._handler = handler
        if logger.level == logging.NOTSET and logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)  # only when nobody chose a level for it

    def write(self, records: Sequence[Record]) -> None:
        for record in records:
            if record.get("kind") != RecordKind.EVENT or record.get("name") != EventName.TRAINING_ITERATIONS:
                continue
            line = progress_line(record.get("attrs") or {})
            if line is not None:
                self.logger.info(line)

    def flush(self) -> None:
        for handler in self.logger.handlers:
            handler.flush()

    def close(self) -> None:
        self.flush()
        if self._handler is not None:
            self.logger.removeHandler(self._handler)
            self.logger.propagate = True
            self._handler = None
