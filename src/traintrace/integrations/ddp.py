"""PyTorch DDP: record each gradient all-reduce as a ``collective`` span.

    from traintrace.integrations.ddp import record_collectives
    model = DistributedDataParallel(module)
    record_collectives(model)          # before the first backward

DDP runs its all-reduce from inside ``backward()``, where a context manager
cannot reach. This registers a DDP communication hook
(``register_comm_hook``) that opens a ``collective`` span when a gradient
bucket is handed to the process group and ends it in the callback of the
all-reduce's future, when the reduced bucket is ready: nothing waits for it.
The span's time is time spent communicating or waiting for slower peers, which
``traintrace ranks`` subtracts to find the rank that is slow in its own work,
and a span still open when a job hangs says that the rank is inside a
collective (``traintrace errors``).

The hook wraps DDP's default all-reduce (or the ``hook`` given, e.g. a
compression hook), so training computes exactly what it did without it.
"""

import contextvars
import functools
import weakref
from collections.abc import Callable
from typing import Any

from .._names import SpanName, SpanStatus, level_of
from .._recorder import warn_once
from .._setup import get_recorder
from ._common import missing_extra

__all__ = ["record_collectives"]

_LEVEL = level_of(SpanName.COLLECTIVE)
#: DDP models whose buffer broadcasts are recorded (record_collectives and the Lightning and Trainer callbacks may ask).
_broadcasts_recorded: "weakref.WeakSet[Any]" = weakref.WeakSet()


def record_collectives(model: Any, state: Any = None, hook: Callable[[Any, Any], Any] | None = None) -> None:
    """Register a communication hook on the DDP ``model`` that records its all-reduces.

    ``state`` and ``hook`` are what you would pass to ``model.register_comm_hook``
    (default: DDP's own all-reduce over the model's process group). Call it once,
    before the first backward pass; DDP accepts one hook per model.
    """
    try:
        import torch
        from torch.distributed import GradBucket  # type: ignore[attr-defined]
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    except ImportError as exc:  # pragma: no cover - torch is the caller's
        raise missing_extra("torch", "torch", exc) from None
    inner: Callable[[Any, Any], Any] = hook or default_hooks.allreduce_hook

    # DDP checks the hook's annotations against these very classes (no string annotations here).
    def traced(hook_state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        rec = get_recorder()
        if rec is None or rec.max_level < _LEVEL:
            plain: torch.futures.Future[torch.Tensor] = inner(hook_state, bucket)
            return plain
        try:
            size = int(bucket.buffer().numel() * bucket.buffer().element_size())
        except Exception:  # noqa: BLE001 - the size is a detail
            size = None
        # A copied context: the span is opened without becoming the training thread's current span.
        span = contextvars.copy_context().run(
            rec.start, SpanName.COLLECTIVE, {"op": "all_reduce", "bytes": size}, level=_LEVEL
        )
        future = inner(hook_state, bucket)

        def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            try:
                value = fut.value()
            except BaseException:
                rec.stop(span, status=SpanStatus.ERROR)
                raise
            rec.stop(span)
            return value

        chained: torch.futures.Future[torch.Tensor] = future.then(done)
        return chained

    model.register_comm_hook(state, traced)
    _record_buffer_broadcasts(model)


def _record_buffer_broadcasts(model: Any) -> None:
    """Record DDP's broadcast of the module's buffers from rank 0 at each forward as a ``collective`` span.

    A model with buffers (BatchNorm's running statistics) has them broadcast before every forward, and rank 0 waits
    there for a rank late to its forward: unrecorded, that wait reads as rank 0's own forward being slow. DDP does
    the broadcast in its ``_sync_buffers`` method, which this times for the models registered here (the class's
    method, wrapped once: forward hooks on the model, the public way, cost a forward 7 to 14 us in PyTorch's hook
    dispatch alone; benchmarks/bench_ddp_buffers.py times the wrapper). A copy of a registered model is not
    registered: it syncs its own buffers, unrecorded. A DDP without ``_sync_buffers`` (another PyTorch) is not
    recorded.
    """
    try:
        syncs = bool(model.broadcast_buffers) and next(iter(model.module.buffers()), None) is not None
    except Exception:  # noqa: BLE001 - not a DDP model this torch knows: its all-reduces are recorded all the same
        return
    try:
        if syncs and _wrap_sync_buffers(type(model)):
            _broadcasts_recorded.add(model)
    except Exception:  # noqa: BLE001 - called from a callback inside training: never raise there
        warn_once("ddp_buffer_sync", "traintrace could not record DDP's buffer broadcast; not recorded")


def _wrap_sync_buffers(ddp_class: type) -> bool:
    """Wrap ``ddp_class._sync_buffers`` (once) to time it for the models in ``_broadcasts_recorded``."""
    original = ddp_class.__dict__.get("_sync_buffers")
    if getattr(original, "_traintrace_original", None) is not None:
        return True
    if not callable(original):
        # A subclass that inherits it: wrap where it is defined.
        owner = next((c for c in ddp_class.__mro__ if callable(c.__dict__.get("_sync_buffers"))), None)
        return owner is not None and owner is not ddp_class and _wrap_sync_buffers(owner)

    @functools.wraps(original)
    def _sync_buffers(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec = get_recorder()
        if rec is None or rec.max_level < _LEVEL or self not in _broadcasts_recorded:
            return original(self, *args, **kwargs)
        try:
            span = rec.start(SpanName.COLLECTIVE, {"op": "broadcast", "tensors": "buffers"}, level=_LEVEL)
        except Exception:  # noqa: BLE001 - never into training: this broadcast is not recorded
            warn_once("ddp_buffer_sync", "traintrace could not record DDP's buffer broadcast; not recorded")
            return original(self, *args, **kwargs)
        try:
            result = original(self, *args, **kwargs)
        except BaseException as exc:
            # A peer gone mid-broadcast: the span ends with the exception, recorded at it.
            span.__exit__(type(exc), exc, exc.__traceback__)
            raise
        rec.stop(span)
        return result

    _sync_buffers._traintrace_original = original  # type: ignore[attr-defined]
    ddp_class._sync_buffers = _sync_buffers  # type: ignore[attr-defined]
    return True
