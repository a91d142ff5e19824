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
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import events
from ._identity import safe_component, scheduler_job_id
from .events import EventSource, EventType
from .integrations.torchelastic import DESTINATION, TorchEventHandler, install_torchelastic_bridge, signal_received

__all__ = [
    "DESTINATION",
    "TorchEventHandler",
    "choose_job_id",
    "install_torchelastic_bridge",
    "main",
    "start_agent_stream",
]

log = logging.getLogger("traintrace.lib")

_AGENT = EventSource.AGENT


# ---------------------------------------------------------------- the launcher


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


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
    from ._config import FileBackendConfig, build_config
    from ._setup import start_stream
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
    config.backends.pop("console", None)  # the agent has no steps; the ranks print progress
    config.rank, config.world_size = 0, 1
    config.local_rank, config.local_world_size, config.restart_count = 0, 1, 0
    rec = start_stream(config, (), {"role": "agent", "launch": info})
    identity = rec.identity
    if workers_config.manifest and "file" in config.backends and identity is not None:
        try:
            # The workers' configuration, which is what the manifest describes.
            folder = job_dir(config, identity)
            write_manifest(folder, workers_config, identity, created_by="agent", launch=info)
        except OSError as exc:
            log.warning("traintrace: could not write the job manifest: %s", exc)
    return rec


def main(argv: Sequence[str] | None = None) -> None:
    """The ``traintrace-run`` entry point: torchrun's arguments, torchrun's behaviour."""
    from . import _run_options

    try:
        from torch.distributed import run as torchrun_module
    except ImportError:
        torchrun_module = None  # type: ignore[assignment]
    torchrun: Any = torchrun_module
    try:
        options, argv = _run_options.split(
            sys.argv[1:] if argv is None else argv, _run_options.flags_of(torchrun and torchrun.get_args_parser())
        )
    except _run_options.OptionError as exc:
        sys.stderr.write(f"traintrace-run: {exc}\n")
        raise SystemExit(2) from None
    if options.help:
        _run_options.print_help(None if torchrun is None else torchrun.get_args_parser())
        raise SystemExit(0)
    if torchrun is None:
        sys.stderr.write("traintrace-run needs torch: pip install 'traintrace[torch]'\n")
        raise SystemExit(2)
    if options.metrics_port is not None:
        from . import _prometheus

        try:
            _prometheus.require()
        except ImportError as exc:
            sys.stderr.write(f"traintrace-run: {exc}\n")
            raise SystemExit(2) from None
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
    metrics = _serve_metrics(options, job_id, rec)
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
        sigval = getattr(exc, "sigval", None)  # torchrun's SignalException: the launcher itself got a signal
        if isinstance(sigval, int):
            summary["signal"] = _signal_name(sigval)
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            summary["failed_ranks"] = sorted(int(rank) for rank in failures)
        raise
    finally:
        received = signal_received()
        if "signal" not in summary and received is not None:
            summary["signal"] = _signal_name(received)
        summary["duration_s"] = round(time.monotonic() - started, 3)
        try:
            events.record(EventType.JOB_END, exit_code=exit_code, data=summary, source=_AGENT)
            from .publisher import get_default_event_publisher

            get_default_event_publisher().flush(2.0)
        finally:  # a second signal (Ctrl-C pressed twice) raises here too: the stream still closes
            if rec is not None:
                rec.close()
            if metrics is not None:
                metrics.close()


def _serve_metrics(options: Any, job_id: str, rec: Any) -> Any:
    """Start the Prometheus endpoint for this node's ranks (``--metrics-port``), or None."""
    if options.metrics_port is None:
        return None
    from ._config import build_config
    from ._prometheus import MetricsServer

    folder = Path(build_config(job_id=job_id).log_dir) / safe_component(job_id)
    host = rec.identity.host if rec is not None else None
    try:
        server = MetricsServer(folder, options.metrics_port, options.metrics_host, host=host)
    except OSError as exc:
        log.warning("traintrace: cannot serve metrics on port %s (%s); launching anyway", options.metrics_port, exc)
        return None
    sys.stderr.write(
        f"traintrace-run: Prometheus metrics at http://{options.metrics_host or '0.0.0.0'}:{server.port}/metrics\n"
    )
    return server


if __name__ == "__main__":
    main()
