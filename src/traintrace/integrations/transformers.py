"""Hugging Face Transformers: one callback records a ``Trainer`` run.

    from traintrace.integrations.transformers import TraintraceTrainerCallback

    trainer = Trainer(model, args, train_dataset=..., callbacks=[TraintraceTrainerCallback()])

Records the training loop, every optimizer step as an ``iteration`` span
(with ``step``, ``batch_size``, ``tokens`` and the loss, learning rate and
grad norm the Trainer logs), the optimizer step, evaluations with their
metrics, checkpoint saves (after the write, with the folder and its size)
and errors. See docs/integrations/transformers.md for the record each hook
produces.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from .. import _api
from .._checkpoint import measure_size
from .._config import Config, build_config
from .._names import EventName, SpanName, SpanStatus, Verbosity, level_of
from .._recorder import Recorder, Span, current_span
from ..backends._scalars import framework_logs_metrics
from ._common import batch_info, ensure_recorder, missing_extra

try:
    import transformers
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise missing_extra("transformers", "transformers", _exc) from None

__all__ = ["TraintraceTrainerCallback"]

_INFO = int(Verbosity.INFO)
_ITERATION = level_of(SpanName.ITERATION)
_PHASE = level_of(SpanName.OPTIMIZER_STEP)
_WAIT = level_of(SpanName.DATA_LOADING)
_COLLECTIVE = level_of(SpanName.COLLECTIVE)

#: The Trainer's own logs that belong to the step, not to evaluation or the run summary.
_STEP_KEYS = frozenset({"loss", "grad_norm", "learning_rate", "epoch", "num_input_tokens_seen"})


def _find_trainer(depth: int = 8) -> Any:
    """The ``Trainer`` whose callback handler is calling us, found on the stack."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, transformers.Trainer):
            return candidate
        frame = frame.f_back
    return None


class TraintraceTrainerCallback(TrainerCallback):
    """Records a Hugging Face ``Trainer`` run with traintrace.

    When traintrace is not configured yet, the callback configures it with
    the Trainer's process index, world size and local process index, from
    ``config`` and ``settings`` (the keyword arguments of
    :func:`traintrace.configure`).

    The Trainer has no hooks around a save, an evaluation or an error; the
    callback wraps the methods of its own Trainer instance (``train``,
    ``training_step``, ``compute_loss``, ``get_batch_samples``, ``_get_num_items_in_batch``, ``evaluate``,
    ``_save_checkpoint``) to time them (forward is ``compute_loss`` in a training step, backward the rest of
    the step, data loading ``get_batch_samples``, the gather of its token count a collective) and to record
    an exception once; the wrappers stay for the Trainer's life, so
    a later ``trainer.evaluate()`` is recorded too.
    """

    def __init__(self, config: Config | None = None, *, wrap_trainer: bool = True, **settings: Any) -> None:
        if config is not None or settings:
            build_config(config, **settings)  # raises ConfigError now
        self.config = config
        self.settings = settings
        self.wrap_trainer = wrap_trainer
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._rec: Recorder | None = None
        self._info = self._trace = self._profile = False
        self._app: Span | None = None
        self._loop: Span | None = None
        self._iter: Span | None = None
        self._iter_pending = False
        self._phase: Span | None = None
        self._wait: Span | None = None
        self._gather: Span | None = None
        self._in_step = False  # inside a training step with phases recorded: compute_loss is forward
        self._eval: Span | None = None
        self._save: Span | None = None
        self._step_samples = 0
        self._step_tokens = 0
        self._tokens_seen = 0
        self._trainer: Any = None
        self._wrapped: list[tuple[str, Any]] = []
        self._model_seen = 0  # id() of the last model a training step ran (its buffer broadcasts recorded)

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config, "settings": self.settings, "wrap_trainer": self.wrap_trainer}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_runtime()

    # ------------------------------------------------------------ setup
    def _ensure(self, args: TrainingArguments) -> None:
        rec = self._rec
        if rec is not None and not rec.closed:
            return
        rec, _ = ensure_recorder(
            self.config,
            settings=self.settings,
            rank=int(getattr(args, "process_index", 0)),
            world_size=int(getattr(args, "world_size", 1)),
            local_rank=int(getattr(args, "local_process_index", 0)),
            node_rank=None,
        )
        self._rec = rec
        level = rec.max_level
        self._info = level >= _INFO
        self._trace = level >= _ITERATION
        self._profile = level >= _PHASE

    def _start(self, name: str, attrs: Mapping[str, Any] | None, level: int) -> Span | None:
        rec = self._rec
        if rec is None or rec.closed or level > rec.max_level:
            return None
        return rec.start(name, attrs, level=level)

    def _attach(self, trainer: Any) -> None:
        if trainer is None or self._trainer is trainer or not self.wrap_trainer:
            return
        self._detach()
        self._trainer = trainer
        for name, make in (
            ("train", self._wrap_train),
            ("training_step", self._wrap_training_step),
            ("compute_loss", self._wrap_compute_loss),
            ("get_batch_samples", self._wrap_get_batch_samples),
            ("_get_num_items_in_batch", self._wrap_count_items),
            ("evaluate", self._wrap_evaluate),
            ("_save_checkpoint", self._wrap_save),
        ):
            original = getattr(trainer, name, None)
            if original is None:
                continue
            wrapped = functools.wraps(original)(make(original))
            try:
                setattr(trainer, name, wrapped)
            except Exception:  # noqa: BLE001 - a Trainer subclass with slots or properties
                continue
            self._wrapped.append((name, wrapped))

    def _detach(self) -> None:
        trainer, self._trainer = self._trainer, None
        while self._wrapped:
            name, wrapped = self._wrapped.pop()
            if trainer is not None and trainer.__dict__.get(name) is wrapped:
                del trainer.__dict__[name]

    # ------------------------------------------------------------ wrappers
    def _wrap_train(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def train(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            except BaseException as exc:
                self._failed(exc)
                raise

        return train

    def _wrap_training_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if self._iter is not None:
                size, tokens = batch_info(inputs)
                if size is not None:
                    self._step_samples += size
                if tokens is not None:
                    self._step_tokens += tokens
            self._in_step = self._profile and self._iter is not None
            if self._in_step and id(model) != self._model_seen:
                # The Trainer's DDP model: its broadcast of the buffers before each forward, where rank 0 waits for
                # a late rank, is recorded as a collective (not read as rank 0's own forward).
                self._model_seen = id(model)
                from .ddp import _record_buffer_broadcasts

                _record_buffer_broadcasts(model)
            try:
                result = original(model, inputs, *args, **kwargs)
            except BaseException as exc:
                self._failed(exc)
                raise
            finally:
                self._in_step = False
            self._end_phase()  # backward: from the loss to the end of the step (accelerator.backward)
            return result

        return training_step

    def _wrap_get_batch_samples(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """Data loading: the Trainer fetches the batches of each optimizer step here (transformers 4.46 on),
        outside the step's hooks; a dataset or loader worker that fails raises here."""

        def get_batch_samples(*args: Any, **kwargs: Any) -> Any:
            if self._loop is None or self._wait is not None:
                return original(*args, **kwargs)
            if self._iter_pending:
                self._end_log_gather()  # a step the Trainer did not log after all: no gather then
            self._wait = self._start(SpanName.DATA_LOADING, None, _WAIT)
            try:
                result = original(*args, **kwargs)
            except BaseException as exc:
                self._failed(exc)  # recorded at the wait, the innermost open span
                raise
            wait, self._wait = self._wait, None
            if wait is not None:
                _api.stop(wait)
            return result

        return get_batch_samples

    def _wrap_count_items(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """Inside the fetch, the Trainer gathers each step's token count from every rank
        (``average_tokens_across_devices``): a ``collective`` span, so that a rank waiting there for a peer whose
        loader hangs is told apart from that peer (both are in data loading)."""

        def count_items(*args: Any, **kwargs: Any) -> Any:
            trainer = self._trainer
            arguments = getattr(trainer, "args", None)
            if (
                self._wait is None
                or int(getattr(arguments, "world_size", 1) or 1) < 2
                or not getattr(arguments, "average_tokens_across_devices", False)
            ):
                return original(*args, **kwargs)
            span = self._gather = self._start(SpanName.COLLECTIVE, {"op": "all_gather"}, _COLLECTIVE)
            result = original(*args, **kwargs)  # an exception: get_batch_samples' wrapper records it here
            self._gather = None
            if span is not None:
                _api.stop(span)
            return result

        return count_items

    def _wrap_compute_loss(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """Forward, when the Trainer computes the loss inside a training step (not in evaluation); backward
        begins when it returns. The Trainer has no hooks for either."""

        def compute_loss(*args: Any, **kwargs: Any) -> Any:
            if not self._in_step:
                return original(*args, **kwargs)
            self._end_phase()
            self._phase = self._start(SpanName.FORWARD, None, _PHASE)
            result = original(*args, **kwargs)  # an exception: training_step's wrapper ends the phase as failed
            self._end_phase()
            self._phase = self._start(SpanName.BACKWARD, None, _PHASE)
            return result

        return compute_loss

    def _end_phase(self) -> None:
        phase = self._phase
        if phase is not None:
            self._phase = None
            _api.stop(phase)

    def _wrap_evaluate(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def evaluate(*args: Any, **kwargs: Any) -> Any:
            self._end_pending_iteration()
            state = getattr(self._trainer, "state", None)
            step = getattr(state, "global_step", None)
            span = self._start(SpanName.VALIDATION, {"global_step": step} if step is not None else None, _INFO)
            self._eval = span
            try:
                result = original(*args, **kwargs)
            except BaseException as exc:
                self._eval = None
                if span is not None:
                    if isinstance(exc, Exception):
                        _api.error(exc, name=EventName.EXCEPTION)
                    _api.stop(span, status=SpanStatus.ERROR)
                raise
            if self._eval is span and span is not None:
                self._eval = None
                _api.stop(span, result if isinstance(result, Mapping) else None)
            return result

        return evaluate

    def _wrap_save(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            self._end_pending_iteration()
            state = getattr(self._trainer, "state", None)
            attrs = {
                "current_iteration": getattr(state, "global_step", None),
                "checkpoint_strategy": "sync",
                "checkpoint_writer": self._writes_model(),
            }
            span = self._start(SpanName.CHECKPOINT_SAVE_SYNC, attrs, _INFO)
            self._save = span
            try:
                return original(*args, **kwargs)
            except BaseException as exc:
                self._save = None
                if span is not None:
                    if isinstance(exc, Exception):
                        _api.error(exc, name=EventName.EXCEPTION)
                    _api.stop(span, status=SpanStatus.ERROR)
                raise
            # The span ends in on_save, right after this returns, with the folder and its size.

        return save_checkpoint

    def _writes_model(self) -> bool | None:
        """Whether this rank writes the model in a save: under DDP only process zero does (``should_save``) and the
        others save their RNG state alone, so their saves are not comparable with its; with FSDP or DeepSpeed every
        rank writes its shard. ``None`` where the Trainer does not say."""
        trainer = self._trainer
        try:
            if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
                return True
            should_save = trainer.args.should_save
        except Exception:  # noqa: BLE001 - a Trainer without these: the save is recorded as before
            return None
        return should_save if isinstance(should_save, bool) else None

    def _failed(self, exc: BaseException) -> None:
        rec = self._rec
        if rec is not None and not rec.closed and isinstance(exc, Exception):
            # Recorded at the innermost open span, once however often it is passed on.
            rec.error(exc, name=EventName.EXCEPTION)
        elif rec is not None and not rec.closed and isinstance(exc, KeyboardInterrupt):  # Ctrl-C
            held = (self._gather, self._wait, self._phase, self._iter, self._save, self._eval, self._loop, self._app)
            innermost = next((span for span in held if span is not None), None)
            rec.record_interrupt(exc, innermost.id if innermost is not None else 0)
        status = SpanStatus.ERROR if isinstance(exc, Exception) else SpanStatus.TERMINATED
        self._iter_pending = False
        for attr in ("_gather", "_wait", "_phase", "_iter", "_save", "_eval", "_loop", "_app"):
            span = getattr(self, attr)
            if span is not None:
                setattr(self, attr, None)
                _api.stop(span, status=status)
        if rec is not None and not rec.closed:
            rec.flush()

    # ------------------------------------------------------------ hooks
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._ensure(args)
        self._attach(_find_trainer())

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._ensure(args)
        # The Trainer's report_to integrations send its logs (loss, learning rate, ...): traintrace's
        # trackers then log only their own figures (docs/integrations/trackers.md).
        report_to = getattr(args, "report_to", None) or []
        report_to = [report_to] if isinstance(report_to, str) else list(report_to)
        framework_logs_metrics("transformers", any(r not in ("none", None) for r in report_to))
        if self._trainer is None:
            self._attach(_find_trainer())
        if not self._info:
            return
        if current_span() is None:
            self._app = self._start(
                SpanName.APPLICATION,
                {
                    "framework": "transformers",
                    "framework_version": transformers.__version__,
                    "rank": int(args.process_index),
                    "world_size": int(args.world_size),
                },
                _INFO,
            )
        attrs: dict[str, Any] = {
            "global_step": int(state.global_step),
            "total_iterations": int(state.max_steps),
            "num_train_epochs": state.num_train_epochs,
            "per_device_train_batch_size": int(args.per_device_train_batch_size),
            "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
            "world_size": int(args.world_size),
        }
        self._loop = self._start(SpanName.TRAINING_LOOP, attrs, _INFO)
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._end_pending_iteration()
        loop, self._loop = self._loop, None
        if loop is not None:
            _api.stop(loop, {"global_step": int(state.global_step), "epoch": state.epoch})
        app, self._app = self._app, None
        if app is not None:
            _api.stop(app)
        rec = self._rec
        if rec is not None and not rec.closed:
            rec.flush()

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._iter_pending:
            self._end_pending_iteration()
        if not self._trace:
            return
        self._step_samples = 0
        self._step_tokens = 0
        self._iter = self._start(SpanName.ITERATION, {"step": state.global_step, "epoch": state.epoch}, _ITERATION)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._end_phase()
        if self._profile and self._iter is not None:
            self._phase = self._start(SpanName.OPTIMIZER_STEP, None, _PHASE)

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._end_phase()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        span = self._iter
        if span is None:
            return
        metrics: dict[str, Any] = {}
        if self._step_samples:
            metrics["batch_size"] = self._step_samples
        tokens = self._step_tokens
        seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        if seen > self._tokens_seen:
            tokens = seen - self._tokens_seen
        self._tokens_seen = seen
        if tokens:
            metrics["tokens"] = tokens
        if metrics:
            span.add_metrics(metrics)
        if control.should_log:
            # The Trainer logs this step's loss, learning rate and grad norm next (on_log), after gathering the
            # loss from every rank: a collective, in which the others wait for a rank that fails or hangs after
            # its backward (in the optimizer's step, say).
            self._iter_pending = True
            if self._gather is None and int(getattr(args, "world_size", 1) or 1) > 1:
                self._gather = self._start(SpanName.COLLECTIVE, {"op": "all_gather"}, _COLLECTIVE)
            return
        self._iter = None
        _api.stop(span)

    def _end_log_gather(self) -> None:
        """End the loss gather begun at a logged step's end (on_log, or the Trainer did not log after all)."""
        span, self._gather = self._gather, None
        if span is not None:
            _api.stop(span)

    def _end_pending_iteration(self, logs: Mapping[str, Any] | None = None) -> None:
        self._end_log_gather()
        self._iter_pending = False
        span, self._iter = self._iter, None
        if span is not None:
            _api.stop(span, logs)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not logs:
            return
        if self._iter_pending:
            self._end_pending_iteration({k: v for k, v in logs.items() if k in _STEP_KEYS})
            return
        if any(key.startswith("eval_") for key in logs):
            return  # already on the validation span (on_evaluate)
        if self._loop is not None:
            # The run's summary (train_runtime, train_loss, ...), logged once before on_train_end.
            self._loop.add_metrics(logs)
        elif self._info:
            _api.event("log", {**logs, "step": state.global_step})

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not metrics or not self._info:
            return
        span = self._eval
        if span is not None:
            span.add_metrics(metrics)
        else:
            _api.event("evaluate", {**metrics, "step": state.global_step})

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if not self._info:
            return
        try:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            prefix = PREFIX_CHECKPOINT_DIR
        except ImportError:
            prefix = "checkpoint"
        folder = str(Path(args.output_dir or ".") / f"{prefix}-{state.global_step}")
        metrics: dict[str, Any] = {
            "current_iteration": int(state.global_step),
            "checkpoint_directory": folder,
        }
        size = measure_size(folder)
        if size is not None:
            metrics["checkpoint_size"] = size
        span, self._save = self._save, None
        if span is None:
            # No wrapper: the write is over, its duration unknown; the record still says it happened.
            should_save = getattr(args, "should_save", None)
            writer = should_save if isinstance(should_save, bool) else None
            span = self._start(
                SpanName.CHECKPOINT_SAVE_SYNC, {"checkpoint_strategy": "sync", "checkpoint_writer": writer}, _INFO
            )
        if span is not None:
            _api.stop(span, metrics)
