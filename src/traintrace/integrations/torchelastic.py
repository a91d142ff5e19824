"""The torchelastic bridge: torch's elastic events, rendezvous events and metrics as lifecycle events.

:func:`install_torchelastic_bridge` is what ``traintrace-run`` installs in its
agent (:mod:`traintrace.launch`); programs that call
``torch.distributed.launcher.elastic_launch`` themselves call it and
``configure()`` instead. Needs torch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from .. import _progress, events
from ..events import EventSource, EventType

__all__ = ["DESTINATION", "TorchEventHandler", "install_torchelastic_bridge", "signal_received"]

log = logging.getLogger("traintrace.lib")

#: The name the bridge registers among torchelastic's event handlers.
DESTINATION = "traintrace"

_AGENT = EventSource.AGENT


# ---------------------------------------------------------------- torch events


def _unwrap(value: Any) -> Any:
    # torch wraps some metadata values in 1-tuples, which JSON makes lists.
    if isinstance(value, list | tuple) and len(value) == 1:
        return value[0]
    return value


def _int_or_none(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def _on_torch_event(payload: Mapping[str, Any]) -> None:
    """Turn one torchelastic ``Event`` (as serialised) into a lifecycle event."""
    name = str(payload.get("name", ""))
    metadata = payload.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        metadata = {}
    state = str(metadata.get("state") or name.rsplit(".", 1)[-1])
    data: dict[str, Any] = {"torch_event": name}
    for key, value in metadata.items():
        if key != "metadata" and value is not None:
            data[key] = value
    inner = metadata.get("metadata")
    if isinstance(inner, str):
        try:
            parsed = json.loads(inner)
        except ValueError:
            parsed = {}
        if isinstance(parsed, dict):
            for key, raw in parsed.items():
                value = _unwrap(raw)
                if value is not None:
                    data.setdefault(key, value)
    restart = _int_or_none(metadata.get("agent_restarts"))
    group_rank = _int_or_none(metadata.get("group_rank"))
    identity: dict[str, Any] = {}
    if restart is not None:
        identity["restart"] = restart
    if group_rank is not None:
        identity["node_rank"] = group_rank
    source = str(payload.get("source", "AGENT")).upper()
    if source == "WORKER":
        local_rank = _int_or_none(data.get("local_rank"))
        global_rank = _int_or_none(metadata.get("global_rank"))
        if global_rank is not None:
            identity["rank"] = global_rank
        if local_rank is not None:
            identity["local_rank"] = local_rank
        pid = _int_or_none(metadata.get("worker_id"))
        if pid is not None:
            data["pid"] = pid
        data.pop("worker_id", None)
        if state == "START":
            events.record(EventType.WORKER_START, local_rank, None, data, source=_AGENT, identity=identity)
            return
        exit_code = _int_or_none(data.pop("exit_code", None))
        if state == "SUCCEEDED" and exit_code is None:
            exit_code = 0
        if state == "FAILED" and not _bridge_state.get("monitor_wrapped"):
            failure = EventType.WORKER_FAILURE
            events.record(failure, local_rank, exit_code, data, source=_AGENT, identity=identity)
        events.record(EventType.WORKER_EXIT, local_rank, exit_code, data, source=_AGENT, identity=identity)
        return
    kind: EventType | str
    if state == "RENDEZVOUS":
        kind = EventType.RENDEZVOUS_COMPLETE
    elif state == "ASSIGN_WORKER_RANKS":
        kind = EventType.RANKS_ASSIGNED
    elif state in ("SUCCEEDED", "FAILED"):
        kind = EventType.AGENT_EXIT
    else:
        kind = f"elastic_{state.lower()}"
    events.record(kind, None, None, data, source=_AGENT, identity=identity)


_RDZV_KINDS: tuple[tuple[str, EventType], ...] = (
    ("attempts to join the next round", EventType.RENDEZVOUS_START),
    ("added itself to the participants", EventType.NODE_JOIN),
    ("removed itself from the participants", EventType.NODE_LEAVE),
    ("since they had no heartbeat", EventType.NODE_LEAVE),
    ("detected dead node", EventType.NODE_LEAVE),
)


def _on_rdzv_event(payload: Mapping[str, Any]) -> None:
    """Turn one torchelastic ``RdzvEvent`` into a lifecycle event."""
    message = str(payload.get("message", ""))
    lowered = message.lower()
    if "keep-alive heartbeat" in lowered:
        return  # every few seconds per node: noise, not lifecycle
    kind = EventType.RENDEZVOUS_UPDATE
    for needle, candidate in _RDZV_KINDS:
        if needle in lowered:
            kind = candidate
            break
    data = {
        key: value
        for key, value in payload.items()
        if value not in (None, "")
        and key
        in ("message", "node_state", "run_id", "hostname", "pid", "master_endpoint", "local_id", "error_trace", "name")
    }
    identity: dict[str, Any] = {}
    rank = _int_or_none(payload.get("rank"))
    if rank is not None:
        identity["node_rank"] = rank
    events.record(kind, None, None, data, source=_AGENT, identity=identity)


class TorchEventHandler(logging.Handler):
    """Receives torchelastic's event log records and records them as lifecycle events.

    torch serialises each event to JSON before logging it and leaves its
    timestamp at 0; this handler parses it and stamps it with the time it
    arrived. Never raises.
    """

    def emit(self, record: logging.LogRecord) -> None:
        try:
            payload = json.loads(record.getMessage())
            if not isinstance(payload, dict):
                return
            if "node_state" in payload:
                _on_rdzv_event(payload)
            else:
                _on_torch_event(payload)
        except Exception as exc:  # a malformed event must not break the agent
            if raised_by_a_signal(exc):
                raise
            log.debug("traintrace: could not read a torchelastic event", exc_info=True)


# ---------------------------------------------------------------- metrics

# Emitted on every monitoring pass (10 a second by default): kept only when they change.
_REPEATED_METRICS = (".remaining_restarts", ".healthy")
_MONITOR_METRICS = ("_monitor_workers.success", "_monitor_workers.duration.ms")


def _metric_handler_class() -> type:
    from torch.distributed.elastic.metrics.api import MetricHandler

    class TraintraceMetricHandler(MetricHandler):
        """Records torchelastic metrics as ``elastic_metric`` events (repeats only on change)."""

        def __init__(self) -> None:
            self.last: dict[tuple[str, str], Any] = {}

        def emit(self, metric_data: Any) -> None:
            try:
                group = str(getattr(metric_data, "group_name", "") or "")
                name = str(getattr(metric_data, "name", ""))
                value = getattr(metric_data, "value", None)
                if name.endswith(_MONITOR_METRICS):
                    return
                if name.endswith(_REPEATED_METRICS):
                    if self.last.get((group, name)) == value:
                        return
                    self.last[(group, name)] = value
                events.record(
                    EventType.ELASTIC_METRIC,
                    None,
                    None,
                    {"group": group, "name": name, "value": value},
                    source=_AGENT,
                )
            except Exception as exc:
                if raised_by_a_signal(exc):
                    raise
                log.debug("traintrace: could not record a torchelastic metric", exc_info=True)

    return TraintraceMetricHandler


# ---------------------------------------------------------------- agent hooks

_bridge_state: dict[str, Any] = {}


def _wrap_agent_methods() -> None:
    """Record worker failures when the agent sees them, and restarts when they begin.

    torchelastic records per-worker events only at the end of the run, so a
    failure followed by a restart leaves no event of its own; these two
    wrappers (on the agent classes, in this launcher process only) fill that
    gap. If torch changes the methods' shape, the bridge runs without them.
    """
    try:
        from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    except ImportError:
        return
    monitor = getattr(LocalElasticAgent, "_monitor_workers", None)
    restart = getattr(SimpleElasticAgent, "_restart_workers", None)
    if monitor is not None and not getattr(monitor, "_traintrace", False):

        def _monitor_workers(self: Any, worker_group: Any) -> Any:
            result = monitor(self, worker_group)
            try:
                _record_failures(self, worker_group, result)
            except Exception as exc:
                if raised_by_a_signal(exc):
                    raise
                log.debug("traintrace: could not record worker failures", exc_info=True)
            return result

        _monitor_workers._traintrace = True  # type: ignore[attr-defined]
        setattr(LocalElasticAgent, "_monitor_workers", _monitor_workers)  # noqa: B010
        _bridge_state["monitor_wrapped"] = True
    if restart is not None and not getattr(restart, "_traintrace", False):

        def _restart_workers(self: Any, worker_group: Any) -> Any:
            try:
                spec = worker_group.spec
                remaining = int(self._remaining_restarts)
                state = getattr(worker_group.state, "name", str(worker_group.state))
                events.record(
                    EventType.WORKER_RESTART,
                    None,
                    None,
                    {
                        "reason": "membership_change" if state == "HEALTHY" else state.lower(),
                        "remaining_restarts": remaining,
                        "max_restarts": spec.max_restarts,
                        "role": spec.role,
                    },
                    source=_AGENT,
                    identity={"restart": spec.max_restarts - remaining, "node_rank": worker_group.group_rank},
                )
            except Exception as exc:
                if raised_by_a_signal(exc):
                    raise
                log.debug("traintrace: could not record a restart", exc_info=True)
            return restart(self, worker_group)

        _restart_workers._traintrace = True  # type: ignore[attr-defined]
        setattr(SimpleElasticAgent, "_restart_workers", _restart_workers)  # noqa: B010


def _record_failures(agent: Any, worker_group: Any, result: Any) -> None:
    failures = getattr(result, "failures", None)
    if not failures:
        return
    spec = worker_group.spec
    restart_count = spec.max_restarts - int(agent._remaining_restarts)
    for global_rank, failure in sorted(failures.items()):
        data: dict[str, Any] = {
            "pid": failure.pid,
            "role": spec.role,
            "state": getattr(result.state, "name", str(result.state)),
            "failed_at": failure.timestamp,
            "message": failure.message,
        }
        try:
            signal_name = failure.signal_name()
        except Exception:  # noqa: BLE001
            signal_name = None
        if signal_name and signal_name != "<N/A>":
            data["signal"] = signal_name
        error_data = failure.error_file_data
        if isinstance(error_data, dict) and error_data.get("message") not in (None, "", "<NONE>"):
            data["error"] = error_data["message"]
        data.update(_progress.dead_worker_fields(int(global_rank), failure.pid))  # its last step and phase
        events.record(
            EventType.WORKER_FAILURE,
            failure.local_rank,
            failure.exitcode,
            data,
            source=_AGENT,
            identity={
                "rank": int(global_rank),
                "local_rank": failure.local_rank,
                "node_rank": worker_group.group_rank,
                "restart": restart_count,
            },
        )


def install_torchelastic_bridge(destination: str = DESTINATION) -> str:
    """Record torchelastic's events and metrics in this (the agent's) process.

    Registers a handler under ``destination`` among torchelastic's event
    handlers (pass ``event_log_handler=destination`` to ``LaunchConfig``, or
    ``--event-log-handler`` to torchrun), attaches it to the rendezvous event
    logger, sets it as the default torchelastic metrics handler, and wraps
    the agent's failure and restart steps. Idempotent; needs torch. Returns
    ``destination``.
    """
    from torch.distributed.elastic import events as torch_events
    from torch.distributed.elastic.events import handlers
    from torch.distributed.elastic.metrics import api as torch_metrics

    handler = _bridge_state.get("handler")
    if handler is None:
        handler = _bridge_state["handler"] = TorchEventHandler()
    if destination not in handlers._log_handlers:
        handlers._log_handlers[destination] = handler
    rdzv = handlers._log_handlers.get("dynamic_rendezvous")
    if rdzv is None or isinstance(rdzv, logging.NullHandler):
        # torch skips building rendezvous events while this is a NullHandler.
        handlers._log_handlers["dynamic_rendezvous"] = handler
    for name in (destination, "dynamic_rendezvous"):
        logger = torch_events._get_or_create_logger(name)
        logger.setLevel(logging.INFO)  # torch takes the level from $LOGLEVEL
        if handler not in logger.handlers:
            logger.addHandler(handler)
    if "metrics" not in _bridge_state:
        _bridge_state["metrics"] = _metric_handler_class()()
        torch_metrics.configure(_bridge_state["metrics"])
    _wrap_agent_methods()
    _note_signals()
    return destination


# ---------------------------------------------------------------- the agent's own signals


def raised_by_a_signal(exc: BaseException) -> bool:
    """torchrun's handler for SIGTERM, SIGINT, SIGHUP and SIGQUIT raises ``SignalException``, an ``Exception``,
    wherever the agent's main thread is: inside a handler of ours too, which must let it through (the agent then
    shuts its workers down) rather than log and swallow it."""
    return type(exc).__name__ == "SignalException" and isinstance(getattr(exc, "sigval", None), int)


def signal_received() -> int | None:
    """The first signal torchrun's handler got in this (the agent's) process, or None: ``traintrace-run`` writes
    it in ``job_end`` even where the exception it raised was caught on its way out (a ``logging`` handler swallows
    what is raised while it writes)."""
    received = _bridge_state.get("signal")
    return received if isinstance(received, int) else None


def _note_signals() -> None:
    """Wrap torchrun's termination handler (looked up in its module each time its process context starts) to note
    the signal first."""
    try:
        from torch.distributed.elastic.multiprocessing import api as mp_api
    except ImportError:
        return
    handler = getattr(mp_api, "_terminate_process_handler", None)
    if handler is None or getattr(handler, "_traintrace", False):
        return

    def _terminate_process_handler(signum: int, frame: Any) -> None:
        _bridge_state.setdefault("signal", signum)
        handler(signum, frame)

    _terminate_process_handler._traintrace = True  # type: ignore[attr-defined]
    setattr(mp_api, "_terminate_process_handler", _terminate_process_handler)  # noqa: B010
