"""``traintrace-run``: torchrun, with its agent's lifecycle recorded beside the workers.

Use it exactly like torchrun::

    traintrace-run --standalone --nproc-per-node 4 --max-restarts 1 train.py --lr 0.1
    python -m traintrace.launch --nnodes 2 --rdzv-id myjob ... train.py

It runs torchrun's own ``main()`` in this process, after:

* choosing one job id for the agent and every worker (``TRAINTRACE_JOB_ID``
  if set, else ``--rdzv-id``, else the scheduler's job id, else a new one) and
  exporting it as ``TRAINTRACE_JOB_ID`` so the workers inherit it, restarts
  included;
* opening the agent's stream, ``<log_dir>/<job>/agent.jsonl``
  (``agent-<host>.jsonl`` with several nodes), with ``role: "agent"`` in its
  header, and the job's ``manifest.json``;
* installing the torchelastic bridge (:func:`install_torchelastic_bridge`).

Configuration is read from ``TRAINTRACE_*`` variables and
``TRAINTRACE_CONFIG``, as for the workers. Programs that call
``torch.distributed.launcher.elastic_launch`` themselves can call
:func:`install_torchelastic_bridge` and ``configure()`` instead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from . import events
from ._identity import safe_component, scheduler_job_id
from .events import EventSource, EventType

__all__ = ["DESTINATION", "choose_job_id", "install_torchelastic_bridge", "main", "start_agent_stream"]

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
        if value not in (None, "") and key in ("message", "node_state", "run_id", "hostname", "pid",
                                               "master_endpoint", "local_id", "error_trace", "name")
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
        except Exception:  # a malformed event must not break the agent
            log.debug("traintrace: could not read a torchelastic event", exc_info=True)


# ---------------------------------------------------------------- metrics

# Emitted on every monitoring pass (10 a second by default): kept only when they change.
_REPEATED_METRICS = (".remaining_restarts", ".healthy")
_MONITOR_METRICS = ("_monitor_workers.success", "_monitor_workers.duration.ms")


def _metric_handler_class() -> type:
    from torch.distributed.elastic.metrics.api import MetricHandler

    class TraintraceMetricHandler(MetricHandler):  # type: ignore[misc]
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
                    EventType.ELASTIC_METRIC, None, None, {"group": group, "name": name, "value": value},
                    source=_AGENT,
                )
            except Exception:
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
            except Exception:
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
            except Exception:
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
    return destination


# ---------------------------------------------------------------- the launcher


def _max_nodes(nnodes: str) -> int:
    try:
        return int(str(nnodes).split(":")[-1])
    except ValueError:
        return 1


def choose_job_id(args: Any, env: Mapping[str, str]) -> str:
    """The job id for the agent and its workers."""
    explicit = env.get("TRAINTRACE_JOB_ID", "").strip()
    if explicit:
        return explicit
    rdzv_id = str(getattr(args, "rdzv_id", "none") or "none")
    if rdzv_id != "none" and not getattr(args, "standalone", False):
        return rdzv_id
    scheduled = scheduler_job_id(env)
    if scheduled:
        return scheduled
    if _max_nodes(getattr(args, "nnodes", "1")) > 1:
        # Agents on other hosts must agree without talking: name the job after its rendezvous.
        endpoint = getattr(args, "rdzv_endpoint", "") or f"{args.master_addr}-{args.master_port}"
        return "job-" + safe_component(str(endpoint))
    return time.strftime("job-%Y%m%d-%H%M%S") + f"-{os.getpid()}"


def _launch_info(args: Any, argv: Sequence[str]) -> dict[str, Any]:
    # Not the command line: it carries secrets (--hf_token=...) and is never recorded.
    info: dict[str, Any] = {
        "nnodes": str(args.nnodes),
        "nproc_per_node": str(args.nproc_per_node),
        "max_restarts": int(args.max_restarts),
        "rdzv_backend": "c10d" if args.standalone else str(args.rdzv_backend),
        "standalone": bool(args.standalone),
        "entrypoint": str(args.training_script),
    }
    try:
        info["world_size"] = _max_nodes(args.nnodes) * int(args.nproc_per_node)
    except ValueError:
        pass
    return info


def _has_option(argv: Sequence[str], *names: str) -> bool:
    script_at = len(argv)
    return any(arg.split("=", 1)[0] in names for arg in argv[:script_at])


def start_agent_stream(job_id: str, info: dict[str, Any] | None = None) -> Any:
    """Configure this process's recorder as a launcher agent's stream; returns the recorder.

    The stream is ``<log_dir>/<job>/agent.jsonl`` (``agent-<host>.jsonl``
    when ``info["nnodes"]`` allows several nodes), with ``role: "agent"``
    and ``launch: info`` in its header; the job's manifest is written with
    the workers' configuration. Configuration comes from ``TRAINTRACE_*``.
    """
    info = dict(info or {})
    from . import _api
    from ._config import FileBackendConfig, build_config
    from .manifest import job_dir, write_manifest

    workers_config = build_config(job_id=job_id)
    config = build_config(job_id=job_id, handle_sigterm=False)
    hosts = "" if _max_nodes(str(info.get("nnodes", "1"))) <= 1 else "-{host}"
    file_cfg = config.backends.get("file")
    if isinstance(file_cfg, FileBackendConfig):
        config.backends["file"] = dataclasses.replace(
            file_cfg, path=f"{{job}}/agent{hosts}.jsonl", ranks="all", verbosity_elsewhere=None
        )
    config.backends.pop("log", None)  # torchrun prints its own lines
    config.rank, config.world_size = 0, 1
    config.local_rank, config.local_world_size, config.restart_count = 0, 1, 0
    with _api._configure_lock:
        rec = _api._start(config, [], {"role": "agent", "launch": info})
    identity = rec.identity  # type: ignore[attr-defined]
    if workers_config.manifest and "file" in config.backends:
        try:
            # The workers' configuration, which is what the manifest describes.
            folder = job_dir(config, identity)
            write_manifest(folder, workers_config, identity, created_by="agent", launch=info)
        except OSError as exc:
            log.warning("traintrace: could not write the job manifest: %s", exc)
    return rec


def main(argv: Sequence[str] | None = None) -> None:
    """The ``traintrace-run`` entry point: torchrun's arguments, torchrun's behaviour."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        from torch.distributed import run as torchrun_module
    except ImportError:
        sys.stderr.write("traintrace-run needs torch: pip install 'traintrace[torch]'\n")
        raise SystemExit(2) from None
    torchrun: Any = torchrun_module
    args = torchrun.parse_args(argv)
    job_id = choose_job_id(args, os.environ)
    os.environ["TRAINTRACE_JOB_ID"] = job_id
    info = _launch_info(args, argv)
    if not _has_option(argv, "--event-log-handler", "--event_log_handler"):
        argv = ["--event-log-handler", DESTINATION, *argv]
        destination = DESTINATION
    else:
        destination = str(torchrun.parse_args(argv).event_log_handler)
    install_torchelastic_bridge(destination)
    rec = None
    try:
        rec = start_agent_stream(job_id, info)
    except Exception as exc:  # noqa: BLE001 - the job runs even if its telemetry cannot
        log.warning("traintrace: the agent stream could not start (%s); launching anyway", exc)
    started = time.monotonic()
    events.record(EventType.JOB_START, data=info, source=_AGENT)
    exit_code = 1
    summary: dict[str, Any] = {}
    try:
        torchrun.main(argv)
        exit_code = 0
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        raise
    except BaseException as exc:
        summary["error_type"] = type(exc).__name__
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            summary["failed_ranks"] = sorted(int(rank) for rank in failures)
        raise
    finally:
        summary["duration_s"] = round(time.monotonic() - started, 3)
        events.record(EventType.JOB_END, exit_code=exit_code, data=summary, source=_AGENT)
        from .publisher import get_default_event_publisher

        get_default_event_publisher().flush(2.0)
        if rec is not None:
            rec.close()


if __name__ == "__main__":
    main()
