"""PyTorch Lightning: one callback records the run.

    from traintrace.integrations.lightning import TraintraceCallback

    trainer = lightning.Trainer(callbacks=[TraintraceCallback()])

Records the stage (fit/validate/test), the training loop, every training
iteration (with ``step``, ``batch_size``, ``tokens`` and the loss), the wait
for each batch, forward / backward / optimizer step, validation
and test loops with the metrics logged through ``self.log``, checkpoint saves
(sync, or the blocking and background parts with ``AsyncCheckpointIO``) and
loads, and an exception once. See docs/integrations/lightning.md for the
record each hook produces.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from time import perf_counter_ns
from typing import Any

from .. import _api
from .._checkpoint import measure_size
from .._config import Config, build_config
from .._names import EventName, SpanName, SpanStatus, Verbosity, level_of
from .._progress import PHASE_CODES, S_COLLECTIVE, S_COLLECTIVE_T0, S_COUNTER, S_PHASE_T0, enter_timed_phase
from .._progress import failed as progress_failed
from .._recorder import Recorder, Span, current_span, warn_once
from .._recorder import _native as _native_core
from ..backends._scalars import framework_logs_metrics
from ._common import (
    batch_info,
    ensure_recorder,
    missing_extra,
    record_finished,
    safe_call,
)

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise missing_extra("lightning", "lightning", _exc) from None

__all__ = ["TraintraceCallback"]

_INFO = int(Verbosity.INFO)
_TRACING = int(Verbosity.TRACING)
_PROFILING = int(Verbosity.PROFILING)
_ITERATION = level_of(SpanName.ITERATION)
_PHASE = level_of(SpanName.FORWARD)
_WAIT = level_of(SpanName.DATA_LOADING)
_WAIT_CODE = PHASE_CODES[SpanName.DATA_LOADING]
_COLLECTIVE = level_of(SpanName.COLLECTIVE)
_COLLECTIVE_CODE = PHASE_CODES[SpanName.COLLECTIVE]
#: The collective Lightning (2.5 and later) runs before fetching each batch under DDP: rank 0 broadcasts whether it
#: received SIGTERM (``_TrainingEpochLoop._broadcast_sigterm_tensor``).
_SIGTERM_BROADCAST = {"op": "broadcast", "tensors": "sigterm"}

#: Attribute names of the phase timings when phases are not recorded as spans.
_TIMING_KEYS = {
    SpanName.FORWARD: "forward_ns",
    SpanName.BACKWARD: "backward_ns",
    SpanName.OPTIMIZER_STEP: "optimizer_ns",
}

#: Per-step hooks by what they time. Lightning skips a callback's hook that is not callable
#: (``_call_callback_hooks``), and each hook it does call costs it one to three microseconds
#: (a profiler context and a name built per call), as much as the callback's own work: a hook
#: the verbosity does not need is set to None on the instance.
_ITERATION_HOOKS = ("on_train_batch_start", "on_train_batch_end")
_PHASE_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")
#: Forward ends when backward begins (zeroing the gradients, between them, is too short to
#: be worth a span, and its hook another call per step).
_UNUSED_HOOKS = ("on_before_zero_grad",)
#: Under automatic optimisation backward ends where the optimizer step begins (Lightning calls
#: ``on_before_optimizer_step`` right after the backward closure returns) or, on a step that
#: accumulates gradients, where the batch ends: ``on_after_backward`` would be one more call per step
#: for the same instant. Manual optimisation keeps it (user code may run between the two).
_AUTOMATIC_UNUSED_HOOKS = ("on_after_backward",)

#: The per-step hooks the native core has in C (``_span.StepHooks``), in the order it takes their Python twins.
_NATIVE_HOOKS = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end")

#: Metric names the callback puts on spans itself; a logged metric never overwrites them.
_RESERVED = frozenset(
    {"step", "batch_size", "tokens", "epoch", "batch_idx", "flops"}
    | {"forward_ns", "backward_ns", "optimizer_ns", "data_loading_ns"}
)


def _loss_of(outputs: Any) -> Any:
    if outputs is None:
        return None
    if type(outputs) is dict:
        return outputs.get("loss")
    if isinstance(outputs, Mapping):
        return outputs.get("loss")
    if getattr(outputs, "shape", None) is not None:
        return outputs
    return None


def _save_path(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    if "path" in kwargs:
        return kwargs["path"]
    return args[1] if len(args) > 1 else None


class TraintraceCallback(Callback):
    """Records a Lightning run with traintrace.

    When traintrace is not configured yet, the callback configures it in
    ``setup`` with the trainer's ``global_rank``, ``world_size``,
    ``local_rank`` and ``node_rank`` (so each DDP rank writes its own
    stream), from ``config`` and ``settings`` (the keyword arguments of
    :func:`traintrace.configure`). When it is configured with another rank
    than the trainer's, it is configured again with the trainer's.

    Args:
        config: the configuration to use when the callback configures traintrace.
        flops_per_step: FLOPs of one training step, put on every iteration
            span as ``flops``; ``"measure"`` counts them once, on the first
            step, with ``torch.utils.flop_counter``.
        batch_size_fn: ``fn(batch) -> int`` when the batch size cannot be read
            from the batch's first tensor.
        tokens_fn: ``fn(batch) -> int`` for the tokens in a batch, when the
            batch has no ``input_ids``.
        log_metrics: put what the module logs with ``self.log`` on the spans.
        metrics_every_n_steps: how often logged step metrics are read
            (default: the trainer's ``log_every_n_steps``).
        trace_checkpoint_io: time checkpoint writes and reads by wrapping the
            strategy's checkpoint IO plugin's methods; without it a save is
            an event from ``on_save_checkpoint``, which fires before the write.
        async_checkpoint: whether checkpoint saves are asynchronous; detected
            from Lightning's ``AsyncCheckpointIO`` when left as None.
        phase_spans: record forward, backward, optimizer step and the wait for
            each batch as spans (the default); with False they become
            ``forward_ns``, ``backward_ns``, ``optimizer_ns`` and
            ``data_loading_ns`` attributes of the iteration span instead,
            which costs about a third as much per step.
        settings: passed to :func:`traintrace.configure`.
    """

    #: Whether ``setup`` may put the per-step hooks' C twins on the instance (tests compare both).
    _native_hooks = True

    def __init__(
        self,
        config: Config | None = None,
        *,
        flops_per_step: float | str | None = None,
        batch_size_fn: Callable[[Any], int | None] | None = None,
        tokens_fn: Callable[[Any], int | None] | None = None,
        log_metrics: bool = True,
        metrics_every_n_steps: int | None = None,
        trace_checkpoint_io: bool = True,
        phase_spans: bool = True,
        async_checkpoint: bool | None = None,
        **settings: Any,
    ) -> None:
        super().__init__()
        if config is not None or settings:
            build_config(config, **settings)  # raises ConfigError now, not in the middle of fit()
        if isinstance(flops_per_step, str) and flops_per_step != "measure":
            raise ValueError(f"flops_per_step: expected a number or 'measure', got {flops_per_step!r}")
        self.config = config
        self.settings = settings
        self.flops_per_step = flops_per_step
        self.batch_size_fn = batch_size_fn
        self.tokens_fn = tokens_fn
        self.log_metrics = log_metrics
        self.metrics_every_n_steps = metrics_every_n_steps
        self.trace_checkpoint_io = trace_checkpoint_io
        self.phase_spans = phase_spans
        self.async_checkpoint = async_checkpoint
        self._reset_runtime()

    # ------------------------------------------------------------ state
    def _reset_runtime(self) -> None:
        self._rec: Recorder | None = None
        self._configured_here = False
        self._info = self._trace = self._profile = False
        self._stage: Span | None = None
        self._loop: Span | None = None
        self._eval: Span | None = None
        self._eval_batches = 0
        self._iter: Span | None = None
        self._epoch: int | None = None  # the training epoch under way (on_train_epoch_start)
        # Phases (forward, backward, optimizer step) and the wait for a batch are timed
        # between hooks and recorded as finished spans; with a span listener (NVTX)
        # present they are opened and closed as usual so that ranges appear live.
        self._phase: str | None = None
        self._phase_span: Span | None = None
        self._mark = 0
        self._wait_t0: int | None = None
        self._wait_span: Span | None = None
        # Lightning's SIGTERM broadcast inside a timed wait for a batch, (start, end): recorded with the wait, as its
        # child (_end_wait), so that the commands count that time as waiting for another rank, not for the batch.
        self._wait_collective: tuple[int, int, str] | None = None
        self._unpatch_loop: Callable[[], None] | None = None
        # A save ended the wait for the next batch: the wait goes on once the save returns (see _resuming_wait).
        self._wait_before_save = False
        self._live_phases = False
        self._timings: dict[str, int] = {}
        self._pending_save: Span | None = None
        self._seen: dict[str, Any] = {}
        self._every = 1
        self._flops: float | None = None
        self._flop_counter: Any = None
        self._patched: list[tuple[Any, str, Any]] = []
        self._async_saves: deque[Span] = deque()
        self._failed = False

    def __getstate__(self) -> dict[str, Any]:
        """Only the settings travel (``ddp_spawn``, checkpoints); spans and the recorder stay."""
        keep = (
            "config",
            "settings",
            "flops_per_step",
            "batch_size_fn",
            "tokens_fn",
            "log_metrics",
            "metrics_every_n_steps",
            "trace_checkpoint_io",
            "phase_spans",
            "async_checkpoint",
        )
        return {key: self.__dict__[key] for key in keep if key in self.__dict__}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_runtime()

    @property
    def state_key(self) -> str:
        return "TraintraceCallback"

    # ------------------------------------------------------------ helpers
    def _start(self, name: str, attrs: dict[str, Any] | None, level: int) -> Span | None:
        """Open a span (the context API's entry, without a ``with``): None when not recorded.

        ``attrs`` must be a fresh dict: the span keeps it, uncopied.
        """
        span = Span(name, attrs, level)
        span.__enter__()
        return span if span._rec is not None else None  # ``open``, without the property's call

    @staticmethod
    def _stop(span: Span | None, metrics: Mapping[str, Any] | None = None, status: str | None = None) -> None:
        if span is not None:
            _api.stop(span, metrics, status=status)

    def _begin_wait(self) -> None:
        if self._live_phases and self.phase_spans:
            self._wait_span = self._start(SpanName.DATA_LOADING, None, _WAIT)
        else:
            # Timed, no span open: the progress file alone says the rank waits for a batch (a rank whose
            # loader hangs is found there).
            self._wait_t0 = t0 = perf_counter_ns()
            rec = self._rec
            # enter_timed_phase(rec, _WAIT_CODE, t0), inline: one frame less in every step
            if rec is not None and (prog := rec._progress) is not None:
                try:
                    prog[S_PHASE_T0] = t0
                    prog[S_COUNTER] = next(rec._progress_seq) | _WAIT_CODE
                except Exception:  # noqa: BLE001 - never raise into training
                    progress_failed(rec)

    def _end_wait(self, status: str = SpanStatus.OK) -> Span | None:
        """End the wait for a batch (if any) with ``status``; the data_loading span it made, if one."""
        t0 = self._wait_t0
        if t0 is not None:
            self._wait_t0 = None
            inner = self._wait_collective
            if not self.phase_spans:
                waited = perf_counter_ns() - t0
                if inner is not None:  # the loader's time: less the collective, which waited for another rank
                    self._wait_collective = None
                    waited -= inner[1] - inner[0]
                self._timings["data_loading_ns"] = waited
                return None
            rec = self._rec
            if rec is None:
                return None
            # The recorder's own call, not record_finished's: one frame less in every step.
            span = rec.record_span(
                SpanName.DATA_LOADING, t0, perf_counter_ns(), parent=self._loop, level=_WAIT, status=status
            )
            if inner is not None:
                self._wait_collective = None
                if span is not None:
                    rec.record_span(
                        SpanName.COLLECTIVE,
                        inner[0],
                        inner[1],
                        parent=span,
                        metrics=dict(_SIGTERM_BROADCAST),
                        level=_COLLECTIVE,
                        status=inner[2],
                    )
            return span
        wait = self._wait_span
        if wait is not None:
            self._wait_span = None
            if status == SpanStatus.OK:
                wait.__exit__(None, None, None)
            else:
                self._stop(wait, None, status)
        return wait

    def _phase_to(self, name: str | None) -> None:
        """End the current phase (if any) and begin ``name`` (if given)."""
        now = perf_counter_ns()
        current = self._phase
        if current is not None:
            self._phase = None
            live = self._phase_span
            if live is not None:
                self._phase_span = None
                live.__exit__(None, None, None)
            elif not self.phase_spans:
                key = _TIMING_KEYS[current]
                self._timings[key] = self._timings.get(key, 0) + now - self._mark
            else:
                rec = self._rec
                if rec is not None:
                    rec.record_span(current, self._mark, now, parent=self._iter, level=_PHASE)
        if name is not None and self._profile and self._iter is not None:
            self._phase = name
            if self._live_phases and self.phase_spans:
                self._phase_span = self._start(name, None, _PHASE)
            else:
                self._mark = now
                rec = self._rec
                # enter_timed_phase(rec, PHASE_CODES[name], now), inline: one frame less in every phase
                if rec is not None and (prog := rec._progress) is not None:
                    try:
                        prog[S_PHASE_T0] = now
                        prog[S_COUNTER] = next(rec._progress_seq) | PHASE_CODES[name]
                    except Exception:  # noqa: BLE001 - never raise into training
                        progress_failed(rec)

    def _end_pending_save(self) -> None:
        pending = self._pending_save
        if pending is not None:
            self._pending_save = None
            _api.stop(pending)

    def _new_logged(self, trainer: pl.Trainer) -> dict[str, Any]:
        """Metrics logged since the last call (values Lightning replaced)."""
        try:
            logged = trainer.logged_metrics
        except Exception:  # noqa: BLE001 - metrics are optional; training is not
            return {}
        seen = self._seen
        fresh: dict[str, Any] = {}
        for key, value in logged.items():
            if seen.get(key) is not value:
                seen[key] = value
                if key not in _RESERVED:
                    fresh[key] = value
        return fresh

    # ------------------------------------------------------------ stage
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._rec = None
        rec, here = ensure_recorder(
            self.config,
            settings=self.settings,
            rank=int(trainer.global_rank),
            world_size=int(trainer.world_size),
            local_rank=int(trainer.local_rank),
            node_rank=int(trainer.node_rank),
        )
        self._rec = rec
        self._configured_here = self._configured_here or here
        # Lightning's loggers send what the module logs (loss, ...): traintrace's trackers then log only
        # their own figures (docs/integrations/trackers.md).
        framework_logs_metrics("lightning", bool(getattr(trainer, "loggers", None)))
        level = rec.max_level
        self._info = level >= _INFO
        self._trace = level >= _ITERATION
        self._profile = level >= _PHASE
        self._live_phases = bool(getattr(rec, "_listeners", ()))
        self._every = max(1, int(self.metrics_every_n_steps or getattr(trainer, "log_every_n_steps", 1) or 1))
        self._failed = False
        self._skip_unneeded_hooks(automatic=bool(getattr(pl_module, "automatic_optimization", True)))
        if isinstance(self.flops_per_step, int | float) and not isinstance(self.flops_per_step, bool):
            self._flops = float(self.flops_per_step)
        if not self._info:
            return
        stage = str(getattr(stage, "value", stage))  # Lightning passes a str enum
        attrs: dict[str, Any] = {
            "stage": stage,
            "framework": "lightning",
            "framework_version": str(getattr(pl, "__version__", "")),
            "rank": int(trainer.global_rank),
            "world_size": int(trainer.world_size),
            "strategy": type(trainer.strategy).__name__,
            "accelerator": type(trainer.accelerator).__name__,
            "num_devices": int(trainer.num_devices),
            "precision": str(trainer.precision),
        }
        if stage == "fit":
            attrs["max_epochs"] = trainer.max_epochs
            attrs["max_steps"] = trainer.max_steps
            attrs["checkpoint_enabled"] = bool(trainer.checkpoint_callbacks)
        # The outermost span is the application unless the user opened one.
        name = SpanName.APPLICATION if current_span() is None else f"lightning_{stage}"
        self._stage = self._start(name, attrs, _INFO)
        if self.trace_checkpoint_io:
            self._wrap_checkpoint_io(trainer)
        if stage == "fit" and not any(obj is trainer for obj, *_ in self._patched):
            self._patch(trainer, "save_checkpoint", self._resuming_wait)

    def _skip_unneeded_hooks(self, *, automatic: bool) -> None:
        """Hide the per-step hooks this verbosity does not need from Lightning (see ``_ITERATION_HOOKS``)."""
        unneeded = list(_UNUSED_HOOKS)
        if automatic:
            unneeded += _AUTOMATIC_UNUSED_HOOKS
        if not self._profile:
            unneeded += _PHASE_HOOKS
        if not self._trace:
            unneeded += _ITERATION_HOOKS
        for hook in (*_ITERATION_HOOKS, *_PHASE_HOOKS, *_UNUSED_HOOKS):
            if hook in unneeded:
                self.__dict__[hook] = None
            else:
                self.__dict__.pop(hook, None)  # a later setup at a higher verbosity needs it again
        self._install_native_hooks()

    def _install_native_hooks(self) -> None:
        """Put the C twins of the per-step hooks (``_span.StepHooks``, src/native/span.c) on the instance, where the
        native core runs and the configuration is the one they cover: phases as spans without a span listener,
        no batch or token function, FLOPs given or none. Lightning calls them between torch's operators, where a
        step's worth of this class's Python costs tens of microseconds; each does what its Python hook does, on the
        same attributes in the same order, and hands what it does not cover to Python: a state (a phase span open,
        a FLOP counter running) to the Python hook whole, before it changes anything; a step whose logged metrics
        are read or whose phase timings are pending to ``_end_iteration``. A hook a subclass overrides stays its
        own."""
        hooks_type = getattr(_native_core, "StepHooks", None)
        if (
            hooks_type is None
            or not self._native_hooks
            or not (self._trace and self._profile and self.phase_spans)
            or self._live_phases
            or self.batch_size_fn is not None
            or self.tokens_fn is not None
            or isinstance(self.flops_per_step, str)
            or not isinstance(self._rec, _native_core.RecorderCore)
        ):
            return
        base = TraintraceCallback
        hooks = hooks_type(
            self,
            (*(getattr(base, name) for name in _NATIVE_HOOKS), base._end_iteration),
            batch_info,
            _loss_of,
            (SpanName.ITERATION, SpanName.FORWARD, SpanName.BACKWARD, SpanName.OPTIMIZER_STEP, SpanName.DATA_LOADING),
            (_ITERATION, _PHASE, _WAIT),
        )
        for name in _NATIVE_HOOKS:
            if getattr(type(self), name) is getattr(base, name):
                self.__dict__[name] = getattr(hooks, name)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._unwrap_checkpoint_io()
        unpatch, self._unpatch_loop = self._unpatch_loop, None
        if unpatch is not None:
            unpatch()
        self._close_open(None)
        stage_span, self._stage = self._stage, None
        if stage_span is not None:
            metrics: dict[str, Any] = {"global_step": int(trainer.global_step)}
            if stage == "fit":
                metrics["epochs"] = int(trainer.current_epoch)
            self._stop(stage_span, metrics, SpanStatus.ERROR if self._failed else None)
        rec = self._rec
        if rec is not None and not rec.closed:
            rec.flush()

    def _close_open(self, status: str | None) -> None:
        """End every span this callback holds, innermost first."""
        self._stop_flop_counter()
        self._end_wait()
        self._end_pending_save()
        self._phase = None
        for attr in ("_phase_span", "_iter", "_eval", "_loop"):
            span = getattr(self, attr)
            if span is not None:
                setattr(self, attr, None)
                self._stop(span, None, status)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._failed = True
        rec = self._rec
        status = SpanStatus.ERROR if isinstance(exception, Exception) else SpanStatus.TERMINATED
        if rec is not None and not rec.closed:
            # Recorded once (however often it is passed on), at the phase it broke if one
            # was running, else at the innermost open span.
            phase = self._phase
            if phase is not None and self._phase_span is None:
                self._phase = None
                broken = record_finished(rec, phase, _PHASE, self._mark, perf_counter_ns(), self._iter, None, status)
                if broken is not None and isinstance(exception, Exception):
                    rec.record_exception(exception, EventName.EXCEPTION, None, broken.id)
            else:
                # Raised while the next batch was fetched (a dataset or a loader worker failed): the wait broke.
                broken = self._end_wait(status)
                if broken is not None and isinstance(exception, Exception):
                    rec.record_exception(exception, EventName.EXCEPTION, None, broken.id)
            if isinstance(exception, Exception):
                rec.error(exception, name=EventName.EXCEPTION)
            elif isinstance(exception, KeyboardInterrupt):  # Ctrl-C, which Lightning catches to shut down
                held = (broken, self._phase_span, self._iter, self._eval, self._loop, self._stage)
                innermost = next((span for span in held if span is not None), None)
                rec.record_interrupt(exception, innermost.id if innermost is not None else 0)
        self._close_open(status)
        stage_span, self._stage = self._stage, None
        self._stop(stage_span, {"global_step": int(trainer.global_step)}, status)
        self._unwrap_checkpoint_io()
        if rec is not None and not rec.closed:
            rec.flush()

    # ------------------------------------------------------------ training
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _note_sigterm_first()
        if not self._info:
            return
        attrs: dict[str, Any] = {"global_step": int(trainer.global_step), "epoch": int(trainer.current_epoch)}
        try:
            attrs["total_iterations"] = int(trainer.estimated_stepping_batches)
        except Exception:  # noqa: BLE001 - unknown for iterable datasets without a length
            pass
        if self._flops is not None:
            attrs["flops_per_step"] = self._flops
        self._loop = self._start(SpanName.TRAINING_LOOP, attrs, _INFO)
        self._seen.clear()
        if self._profile:
            # DDP broadcasts a model's buffers from rank 0 before each forward, where rank 0 then waits for a rank
            # late with its batch: recorded as a collective, that wait is not read as rank 0's own compute.
            from .ddp import _record_buffer_broadcasts

            _record_buffer_broadcasts(getattr(trainer.strategy, "model", None))
            if int(trainer.world_size) > 1:
                self._record_sigterm_broadcast(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_wait()
        loop, self._loop = self._loop, None
        if loop is not None:
            metrics: dict[str, Any] = {
                "global_step": int(trainer.global_step),
                "epochs": int(trainer.current_epoch),
            }
            if self._flops is not None:
                metrics["flops_per_step"] = self._flops
            self._stop(loop, metrics)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning counts the epoch up after on_train_epoch_end: read once here, not at every batch (a property
        # chain, 1 to 2 µs inside a step).
        self._epoch = trainer.current_epoch
        if self._profile:
            self._end_wait()
            self._begin_wait()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch = None
        rec = self._rec
        if self._wait_t0 is not None and rec is not None:
            enter_timed_phase(rec, PHASE_CODES[SpanName.TRAINING_LOOP], perf_counter_ns())  # no batch awaited
        self._end_wait()
        if self._info and self.log_metrics:
            fresh = self._new_logged(trainer)
            if fresh:
                fresh["epoch"] = int(trainer.current_epoch)
                fresh["step"] = int(trainer.global_step)
                _api.event("epoch_end", fresh)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._wait_t0 is not None or self._wait_span is not None:
            self._end_wait()
        if not self._trace:
            return
        step = trainer.global_step
        epoch = self._epoch
        if epoch is None:
            epoch = trainer.current_epoch
        attrs: dict[str, Any] = {"step": step, "batch_idx": batch_idx, "epoch": epoch}
        size = safe_call(self.batch_size_fn, batch, "batch_size") if self.batch_size_fn else None
        tokens = safe_call(self.tokens_fn, batch, "tokens") if self.tokens_fn else None
        if size is None or tokens is None:
            found_size, found_tokens = batch_info(batch)
            size = found_size if size is None else size
            tokens = found_tokens if tokens is None else tokens
        if size is not None:
            attrs["batch_size"] = size
        if tokens is not None:
            attrs["tokens"] = tokens
        if self._flops is not None:
            attrs["flops"] = self._flops
        self._iter = self._start(SpanName.ITERATION, attrs, _ITERATION)
        if self.flops_per_step == "measure" and self._flops is None and self._flop_counter is None:
            self._start_flop_counter()
        if self._profile:
            self._phase_to(SpanName.FORWARD)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        if self._profile:
            self._phase_to(SpanName.BACKWARD)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._phase is not None:
            self._phase_to(None)
            rec = self._rec
            if self._phase_span is None and rec is not None:
                enter_timed_phase(rec, PHASE_CODES[SpanName.ITERATION], perf_counter_ns())  # between phases

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._profile:
            self._phase_to(SpanName.OPTIMIZER_STEP)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._phase is not None:
            self._phase_to(None)
        span = self._iter
        if span is not None:
            self._iter = None
            if self._flop_counter is not None:
                self._stop_flop_counter()
                if self._flops is not None:
                    span.add_metrics(flops=self._flops)
            self._end_iteration(span, trainer, _loss_of(outputs))
        if self._profile:
            self._begin_wait()

    def _end_iteration(self, span: Span, trainer: pl.Trainer, loss: Any) -> None:
        """The iteration's metrics (the loss, logged metrics at their steps, phase timings), then its end.
        (The C twin of ``on_train_batch_end`` calls it for a step whose logged metrics are read.)"""
        timings = self._timings
        if self.log_metrics and trainer.global_step % self._every == 0:
            metrics = self._new_logged(trainer)
            if loss is not None:
                metrics.setdefault("loss", loss)
            if timings:
                metrics.update(timings)
                timings.clear()
            span.add_metrics(metrics)
        elif timings:
            if loss is not None:
                timings["loss"] = loss
            span.add_metrics(timings)
            timings.clear()
        elif loss is not None:
            # add_metrics(loss=loss) without its call: the span is open and this callback's.
            held = span.metrics
            if held is None:
                span.metrics = {"loss": loss}
            else:
                held["loss"] = loss
        span.__exit__(None, None, None)

    # ------------------------------------------------------------ FLOPs
    def _start_flop_counter(self) -> None:
        try:
            from torch.utils.flop_counter import FlopCounterMode

            counter = FlopCounterMode(display=False)
            counter.__enter__()  # type: ignore[no-untyped-call]
            self._flop_counter = counter
        except Exception as exc:  # noqa: BLE001 - FLOPs are optional
            warn_once("flop_counter", f"cannot count FLOPs: {type(exc).__name__}: {exc}")
            self.flops_per_step = None

    def _stop_flop_counter(self) -> None:
        counter, self._flop_counter = self._flop_counter, None
        if counter is None:
            return
        try:
            counter.__exit__(None, None, None)
            total = float(counter.get_total_flops())
            self._flops = total if total > 0 else None
        except Exception as exc:  # noqa: BLE001
            warn_once("flop_counter", f"cannot count FLOPs: {type(exc).__name__}: {exc}")
        if self._flops is None:
            self.flops_per_step = None

    # ------------------------------------------------------------ evaluation
    def _eval_start(self, name: str, trainer: pl.Trainer) -> None:
        self._end_wait()
        self._eval_batches = 0
        if not self._info:
            return
        if self.log_metrics:
            self._new_logged(trainer)  # what was logged before belongs to training
        attrs: dict[str, Any] = {"global_step": int(trainer.global_step), "epoch": int(trainer.current_epoch)}
        if trainer.sanity_checking:
            attrs["sanity_check"] = True
        self._eval = self._start(name, attrs, _INFO)

    def _eval_end(self, trainer: pl.Trainer) -> None:
        span, self._eval = self._eval, None
        if span is None:
            return
        metrics: dict[str, Any] = {"batches": self._eval_batches}
        if self.log_metrics and not trainer.sanity_checking:
            metrics.update(self._new_logged(trainer))
        _api.stop(span, metrics)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_start(SpanName.VALIDATION, trainer)

    def on_validation_batch_end(  # noqa: PLR0917 - Lightning's hook signature
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._eval_batches += 1

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_end(trainer)
        if self._profile and self._loop is not None and not trainer.sanity_checking:
            # Back in the training loop: the wait for the next batch starts.
            self._begin_wait()

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_start(SpanName.TEST, trainer)

    def on_test_batch_end(  # noqa: PLR0917 - Lightning's hook signature
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._eval_batches += 1

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_end(trainer)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_start("predict_loop", trainer)

    def on_predict_batch_end(  # noqa: PLR0917 - Lightning's hook signature
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._eval_batches += 1

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_end(trainer)

    # ------------------------------------------------------------ checkpoints
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Fires on every rank before the write (only global rank 0 writes).
        self._wait_before_save = self._wait_t0 is not None or self._wait_span is not None
        # Since the batch ended, ModelCheckpoint decided to save and broadcast whether the file exists: no wait for
        # a batch, and a rank that does not write waits there for the writer. Timed, that stretch is not recorded
        # (it was, on every rank, and fed the next step's wait on ranks without a save record of their own: a rank
        # late to that broadcast made the other, on a loaded machine, a straggler fetching batches after saves). A
        # live span (a listener present) has been seen begun: it ends here, ``interrupted``, which the commands
        # count as no wait for a batch (as the timed stretch it was not recorded).
        if self._wait_t0 is not None:
            self._wait_t0 = None
            self._wait_collective = None  # (Lightning broadcasts before fetching a batch, not before a save)
        else:
            self._end_wait(SpanStatus.INTERRUPTED)
        if not self._info or any(obj is not trainer for obj, *_ in self._patched):
            return
        # No wrapped checkpoint IO: the save is known only to start here.
        _api.event(
            "checkpoint_save_requested",
            {"current_iteration": int(trainer.global_step), "epoch": int(trainer.current_epoch)},
        )

    def _wrap_checkpoint_io(self, trainer: pl.Trainer) -> None:
        if any(obj is not trainer for obj, *_ in self._patched):
            return
        try:
            io = trainer.strategy.checkpoint_io
        except Exception:  # noqa: BLE001 - strategies without a checkpoint IO plugin
            return
        is_async = self.async_checkpoint
        inner = None
        try:
            from lightning.pytorch.plugins.io import AsyncCheckpointIO

            if isinstance(io, AsyncCheckpointIO):
                inner = io.checkpoint_io
                if is_async is None:
                    is_async = True
        except ImportError:
            pass
        is_async = bool(is_async)
        self._patch(io, "save_checkpoint", self._traced_save(trainer, is_async))
        self._patch(io, "load_checkpoint", self._traced_load())
        if is_async and inner is not None:
            self._patch(inner, "save_checkpoint", self._traced_finalization(trainer))

    def _record_sigterm_broadcast(self, trainer: pl.Trainer) -> None:
        """Time the collective Lightning 2.5 and later runs under DDP before fetching each batch: rank 0 broadcasts
        whether it received SIGTERM, so every rank waits there for rank 0. That wait falls inside the wait for the
        batch, where it was counted as the rank's data loading: a real 2-rank fit whose rank 0 came 28 ms late from
        a save read rank 1's next wait for a batch at 32 ms against rank 0's 5 (rank 1 named a straggler in data
        loading from that step, on a loaded machine). Recorded as a ``collective`` span inside the wait (live with
        the wait, or with the timed wait when it ends); the progress file says ``collective`` meanwhile, so a rank
        left waiting there for a rank that died is found waiting in a collective. A Lightning without that method
        is left as it is."""
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        original = getattr(loop, "_broadcast_sigterm_tensor", None)
        if loop is None or not callable(original) or self._unpatch_loop is not None:
            return

        def broadcast_sigterm_tensor(*args: Any, **kwargs: Any) -> Any:
            rec = self._rec
            if rec is None or rec.closed:
                return original(*args, **kwargs)
            if self._wait_span is not None:  # live: a child span of the live wait
                span = self._start(SpanName.COLLECTIVE, dict(_SIGTERM_BROADCAST), _COLLECTIVE)
                try:
                    result = original(*args, **kwargs)
                except BaseException as exc:
                    self._stop(span, None, _broadcast_status(exc))
                    raise
                self._stop(span)
                return result
            t0 = perf_counter_ns()
            prog = rec._progress
            if prog is not None:
                try:
                    prog[S_COLLECTIVE] += 1
                    prog[S_COLLECTIVE_T0] = t0
                    prog[S_PHASE_T0] = t0
                    prog[S_COUNTER] = next(rec._progress_seq) | _COLLECTIVE_CODE
                except Exception:  # noqa: BLE001 - never raise into training
                    progress_failed(rec)
                    prog = None
            status = SpanStatus.OK
            try:
                return original(*args, **kwargs)
            except BaseException as exc:
                status = _broadcast_status(exc)
                raise
            finally:
                t1 = perf_counter_ns()
                wait_t0 = self._wait_t0
                if prog is not None:
                    try:
                        if prog[S_COLLECTIVE] > 0:
                            prog[S_COLLECTIVE] -= 1
                        code = _WAIT_CODE if wait_t0 is not None else PHASE_CODES[SpanName.TRAINING_LOOP]
                        prog[S_PHASE_T0] = wait_t0 if wait_t0 is not None else t1
                        prog[S_COUNTER] = next(rec._progress_seq) | code
                    except Exception:  # noqa: BLE001
                        progress_failed(rec)
                if wait_t0 is not None and status == SpanStatus.OK:
                    self._wait_collective = (t0, t1, status)
                elif self.phase_spans:  # no wait under way (or it ends here): recorded now, under the loop
                    rec.record_span(
                        SpanName.COLLECTIVE,
                        t0,
                        t1,
                        parent=self._loop,
                        metrics=dict(_SIGTERM_BROADCAST),
                        level=_COLLECTIVE,
                        status=status,
                    )

        loop._broadcast_sigterm_tensor = broadcast_sigterm_tensor

        def unpatch() -> None:
            if loop.__dict__.get("_broadcast_sigterm_tensor") is broadcast_sigterm_tensor:
                del loop.__dict__["_broadcast_sigterm_tensor"]

        self._unpatch_loop = unpatch

    def _resuming_wait(self, save: Callable[..., Any]) -> Callable[..., Any]:
        """``Trainer.save_checkpoint``, after which the wait for the next batch that the save's
        ``on_save_checkpoint`` ended goes on: ModelCheckpoint saves after a batch, every rank (the writer, and the
        others at the barrier after it), and the next batch is fetched once the save returns. Without it, that fetch
        was timed nowhere: a rank slow to fetch the batches after saves only was not seen."""

        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            result = save(*args, **kwargs)
            if self._wait_before_save:  # not after a save that raised: that is no wait for a batch
                self._wait_before_save = False
                self._begin_wait()
            return result

        return save_checkpoint

    def _patch(self, obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        try:
            original = getattr(obj, name)
            wrapped = make(original)
            setattr(obj, name, wrapped)
            self._patched.append((obj, name, wrapped))
        except Exception as exc:  # noqa: BLE001 - an unusual plugin: fall back to hooks
            warn_once("checkpoint_io_wrap", f"cannot time {type(obj).__name__}.{name}: {exc}")

    def _unwrap_checkpoint_io(self) -> None:
        while self._patched:
            obj, name, wrapped = self._patched.pop()
            try:
                if obj.__dict__.get(name) is wrapped:
                    del obj.__dict__[name]
            except Exception:  # noqa: BLE001
                pass

    def _checkpoint_attrs(self, trainer: pl.Trainer, path: Any, strategy: str) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            "current_iteration": int(trainer.global_step),
            "epoch": int(trainer.current_epoch),
            "checkpoint_strategy": strategy,
        }
        if path is not None:
            text = os.fspath(path)
            attrs["checkpoint_path"] = text
            attrs["checkpoint_directory"] = str(Path(text).parent)
        return attrs

    def _traced_save(self, trainer: pl.Trainer, is_async: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            name = SpanName.CHECKPOINT_SAVE_ASYNC if is_async else SpanName.CHECKPOINT_SAVE_SYNC
            strategy = "async" if is_async else "sync"

            def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
                self._end_wait()
                path = _save_path(args, kwargs)
                span = self._start(name, self._checkpoint_attrs(trainer, path, strategy), _INFO) if self._info else None
                if span is not None and is_async:
                    self._async_saves.append(span)
                try:
                    result = original(*args, **kwargs)
                except BaseException as exc:
                    if span is not None:
                        if isinstance(exc, Exception):
                            _api.error(exc, name=EventName.EXCEPTION)
                        self._stop(span, None, SpanStatus.ERROR)
                    raise
                if span is not None:
                    metrics = None if is_async else {"checkpoint_size": measure_size(path)}
                    self._stop(span, metrics)
                return result

            return save_checkpoint

        return make

    def _traced_finalization(self, trainer: pl.Trainer) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
                # Runs on the async plugin's worker thread, in the order saves were submitted.
                link = self._async_saves.popleft() if self._async_saves else None
                rec = self._rec
                span = None
                if rec is not None and not rec.closed and self._info:
                    attrs = dict(link.attrs) if link is not None and link.attrs else {}
                    span = rec.start(SpanName.CHECKPOINT_SAVE_FINALIZATION, attrs, level=_INFO, link=link)
                path = _save_path(args, kwargs)
                try:
                    result = original(*args, **kwargs)
                except BaseException as exc:
                    if span is not None:
                        if isinstance(exc, Exception):
                            _api.error(exc, name=EventName.EXCEPTION)
                        self._stop(span, None, SpanStatus.ERROR)
                    raise
                if span is not None:
                    self._stop(span, {"checkpoint_size": measure_size(path)})
                return result

            return save_checkpoint

        return make

    def _traced_load(self) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def load_checkpoint(path: Any, *args: Any, **kwargs: Any) -> Any:
                span = None
                if self._info:
                    attrs: dict[str, Any] = {"checkpoint_path": os.fspath(path)}
                    size = measure_size(path)
                    if size is not None:
                        attrs["checkpoint_size"] = size
                    span = self._start(SpanName.CHECKPOINT_LOAD, attrs, _INFO)
                try:
                    result = original(path, *args, **kwargs)
                except BaseException as exc:
                    if span is not None:
                        if isinstance(exc, Exception):
                            _api.error(exc, name=EventName.EXCEPTION)
                        self._stop(span, None, SpanStatus.ERROR)
                    raise
                self._stop(span)
                return result

            return load_checkpoint

        return make

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._info:
            _api.event(
                "checkpoint_restored",
                {
                    "global_step": checkpoint.get("global_step"),
                    "epoch": checkpoint.get("epoch"),
                    "lightning_version": checkpoint.get("pytorch-lightning_version"),
                },
            )


def _note_sigterm_first() -> None:
    """Lightning installs its SIGTERM handler just before the loop runs (over traintrace's, which it calls last):
    it broadcasts to the other ranks first, which blocks where a peer is in another collective. traintrace's goes
    over it, to record the signal when it comes (``_setup.noting_sigterm``); Lightning restores its own at the end
    of the run."""
    import signal
    import threading

    from .. import _setup
    from .._recorder import get_active

    rec = get_active()
    if rec is None or not rec.config.handle_sigterm or threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(signal.SIGTERM)
    if not callable(handler) or handler is _setup._on_sigterm or getattr(handler, "traintrace_noting", False):
        return
    try:
        signal.signal(signal.SIGTERM, _setup.noting_sigterm(handler))
    except (ValueError, OSError):
        pass


def _broadcast_status(exc: BaseException) -> str:
    """A SIGTERM broadcast's status when it raised: Lightning raises ``SIGTERMException`` there when rank 0 received
    SIGTERM (the job is being stopped), else an error."""
    if type(exc).__name__ == "SIGTERMException" or not isinstance(exc, Exception):
        return SpanStatus.TERMINATED
    return SpanStatus.ERROR
