"""Training-loop insight: iteration statistics, counters, sampling and the watchdog.

``attach`` wires them to a new recorder at ``configure()``; the functions
below are the public API (``traintrace.set_step_info`` and friends). See
docs/insight.md.
"""

from __future__ import annotations

import logging
from time import perf_counter_ns
from types import TracebackType
from typing import TYPE_CHECKING, Any

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
        #: The native encoder counts plain iterations for these statistics (``IterationStats.absorb``)
        #: when they are the pipeline's only observer.
        self.native_stats: IterationStats | None = self.stats
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
    if not config.statistics or not pipeline.routes:
        return None
    insight = Insight(recorder, pipeline, config, identity)
    count_flops.reset()
    pipeline.observers.append(insight)
    recorder.insight = insight
    insight.start()
    return insight


def _insight(recorder: Recorder | None = None) -> Insight | None:
    rec = recorder or get_active()
    return rec.insight if rec is not None else None


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
