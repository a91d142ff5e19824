"""Training-loop insight: iteration statistics, counters, sampling and the watchdog.

``attach`` wires them to a new recorder at ``configure()``; the functions
below are the public API (``traintrace.set_step_info`` and friends). See
docs/insight.md.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from time import perf_counter_ns
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ._config import ConfigError
from ._monitor import DEFAULT_PHASE_TIMEOUTS, Sampler, Watchdog
from ._peaks import peak_tflops
from ._recorder import Recorder, get_active, warn_once
from ._stats import IterationStats

if TYPE_CHECKING:
    from ._config import Config
    from ._identity import Identity
    from ._pipeline import Pipeline

log = logging.getLogger("traintrace.lib")


class Insight:
    """What one recorder runs besides recording: statistics, sampler, watchdog."""

    def __init__(self, recorder: Recorder, pipeline: Pipeline, config: Config, identity: Identity) -> None:
        peak = config.peak_tflops
        if peak is None and config.accelerator:
            peak = peak_tflops(config.accelerator)
        self.stats = IterationStats(pipeline, config.log_interval, peak)
        self.hold = self.stats.hold
        self.span_ended = self.stats.span_ended
        self.flushing = self.stats.flushing
        self.sampler: Sampler | None = None
        self.watchdog: Watchdog | None = None
        if config.device_sample_interval:
            self.sampler = Sampler(recorder, self.stats, config.device_sample_interval, identity.local_rank)
        if config.hang_timeout:
            self.watchdog = Watchdog(
                recorder,
                self.stats,
                timeout=config.hang_timeout,
                period=config.hang_check_interval,
                phase_timeouts={**DEFAULT_PHASE_TIMEOUTS, **config.phase_timeouts},
                exit_after=config.hang_exit_after,
                exit_code=config.hang_exit_code,
            )

    def start(self) -> None:
        for thread in (self.sampler, self.watchdog):
            if thread is not None:
                thread.start()

    # -- pipeline observer (writer thread) ----------------------------------
    # ``hold(span, started)`` and ``span_ended(span, out)`` are the statistics'
    # own bound methods, set in __init__ to save a call per span.

    def finish(self, out: list[tuple[int, dict[str, Any]]], open_status: str) -> None:
        for thread in (self.sampler, self.watchdog):
            if thread is not None:
                thread.stop()
        self.stats.finish(out, open_status)


def attach(recorder: Recorder, pipeline: Pipeline, config: Config, identity: Identity) -> Insight | None:
    """Start insight for a new recorder; None when statistics are off or nothing records."""
    if not config.statistics or not pipeline._routes:
        return None
    insight = Insight(recorder, pipeline, config, identity)
    count_flops.reset()
    pipeline.observers.append(insight)
    recorder.insight = insight  # type: ignore[attr-defined]
    insight.start()
    return insight


def _insight(recorder: Recorder | None = None) -> Insight | None:
    rec = recorder or get_active()
    return getattr(rec, "insight", None) if rec is not None else None


def validate_settings(config: Config) -> None:
    """Raise ConfigError for a bad insight setting (called by ``Config.validate``)."""
    peak = config.peak_tflops
    if peak is not None and (isinstance(peak, bool) or not isinstance(peak, int | float) or peak <= 0):
        raise ConfigError(f"peak_tflops: expected a positive number, got {peak!r}")
    for name in ("device_sample_interval", "hang_timeout", "hang_check_interval"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError(f"{name}: expected a number of seconds (0 turns it off), got {value!r}")
    if not config.hang_check_interval:
        raise ConfigError("hang_check_interval: must be above 0")
    value = config.hang_exit_after
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
        raise ConfigError(f"hang_exit_after: expected a positive number of seconds, got {value!r}")
    code = config.hang_exit_code
    if isinstance(code, bool) or not isinstance(code, int) or not 1 <= code <= 255:
        raise ConfigError(f"hang_exit_code: expected an exit status from 1 to 255, got {code!r}")
    if not isinstance(config.statistics, bool):
        raise ConfigError(f"statistics: expected true or false, got {config.statistics!r}")
    if config.accelerator is not None and not isinstance(config.accelerator, str):
        raise ConfigError(f"accelerator: expected a device name, got {config.accelerator!r}")
    timeouts = config.phase_timeouts
    if isinstance(timeouts, str):
        # From the environment: "checkpoint_save_sync=3600,validation_loop=7200".
        parsed: dict[str, float] = {}
        for part in timeouts.split(","):
            if not part.strip():
                continue
            name, sep, seconds = part.partition("=")
            try:
                parsed[name.strip()] = float(seconds)
            except ValueError:
                sep = ""
            if not sep:
                raise ConfigError(f"phase_timeouts: expected name=seconds pairs, got {part!r}") from None
        timeouts = config.phase_timeouts = parsed
    if not isinstance(timeouts, Mapping):
        raise ConfigError("phase_timeouts: expected a mapping of span name to seconds")
    for name, seconds in timeouts.items():
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds <= 0:
            raise ConfigError(
                f"phase_timeouts.{name}: expected a positive number of seconds, got {seconds!r}"
            )


# ---------------------------------------------------------------- public API


def set_step_info(
    *,
    batch_size: int | None = None,
    tokens: int | None = None,
    flops: float | None = None,
    num_iterations: int | None = None,
    peak_tflops: float | None = None,
) -> None:
    """Defaults for every following iteration: samples, tokens and FLOPs per step.

    ``flops`` are this process's (one device's) floating-point operations per
    step, forward and backward; ``peak_tflops`` overrides the device's peak
    for MFU. A value given on an iteration (``it.add_metrics(tokens=...)``)
    wins for that step. Applies to iterations that start after the call.
    """
    insight = _insight()
    if insight is None:
        return
    values = {
        "batch_size": batch_size,
        "tokens": tokens,
        "flops": flops,
        "num_iterations": num_iterations,
        "peak_tflops": peak_tflops,
    }
    insight.stats.set_info({k: v for k, v in values.items() if v is not None})


def heartbeat() -> None:
    """Tell the hang watchdog that the job progresses (for work outside iterations)."""
    insight = _insight()
    if insight is not None and insight.watchdog is not None:
        insight.watchdog.beat = perf_counter_ns()


def counters() -> dict[str, Any]:
    """The run's counters as the writer has seen them so far (``flush()`` first).

    ``completed_steps``, ``skipped_steps``, ``consumed_samples``,
    ``consumed_tokens``, ``last_step``; empty before ``configure()``.
    """
    insight = _insight()
    return {} if insight is None else insight.stats.snapshot()


class count_flops:
    """Count the FLOPs of the code inside with torch's FLOP counter, once per run.

    Wrap one training step (forward and backward) in it; the first time, the
    count becomes the ``flops`` per step (as :func:`set_step_info`); later
    entries do nothing. Needs torch (``pip install 'traintrace[torch]'``).
    """

    _done = False

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._mode: Any = None

    def __enter__(self) -> count_flops:
        if not self.enabled or count_flops._done or _insight() is None:
            return self
        try:
            from torch.utils.flop_counter import FlopCounterMode
        except ImportError:
            warn_once("count_flops_torch", "count_flops() needs torch: pip install 'traintrace[torch]'")
            count_flops._done = True
            return self
        try:
            mode: Any = FlopCounterMode(display=False)
            mode.__enter__()
        except Exception:  # noqa: BLE001 - never fail the training step
            warn_once("count_flops_failed", "count_flops() could not start torch's FLOP counter")
            count_flops._done = True
            return self
        self._mode = mode
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        mode, self._mode = self._mode, None
        if mode is None:
            return
        try:
            mode.__exit__(exc_type, exc, tb)
            if exc is None:
                count_flops._done = True
                total = int(mode.get_total_flops())
                if total > 0:
                    set_step_info(flops=total)
        except Exception:  # noqa: BLE001 - never fail the training step
            warn_once("count_flops_failed", "count_flops() could not count this step")

    @classmethod
    def reset(cls) -> None:
        """Count again on the next entry (e.g. after the model changed)."""
        cls._done = False
