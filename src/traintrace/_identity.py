"""Who is recording: rank, world size, host and job, read from the environment.

No torch import: launchers put everything in environment variables. Explicit
configuration always wins over what is detected here (see docs/configuration.md).
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class Identity:
    """Where a stream comes from."""

    job_id: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    restart_count: int
    host: str
    pid: int
    run_id: str | None = None
    launcher: str | None = None


# Each launcher: (name, variable that proves it, rank, local rank, world size,
# local world size, node rank, restart count, job id). Earlier entries win.
_LAUNCHERS: tuple[tuple[str, str, str, str, str, str, str, str, str], ...] = (
    (
        "torchelastic",
        "TORCHELASTIC_RUN_ID",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_RUN_ID",
    ),
    (
        "slurm",
        "SLURM_PROCID",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_NTASKS",
        "SLURM_NTASKS_PER_NODE",
        "SLURM_NODEID",
        "SLURM_RESTART_COUNT",
        "SLURM_JOB_ID",
    ),
    (
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "OMPI_COMM_WORLD_NODE_RANK",
        "",
        "",
    ),
    ("pmi", "PMI_RANK", "PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", "MPI_LOCALNRANKS", "", "", ""),
    ("env", "RANK", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "", ""),
)


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    if not name:
        return default
    raw = env.get(name, "")
    # SLURM writes counts like "4(x2)"; the leading number is the one that matters.
    match = re.match(r"\s*(-?\d+)", raw)
    return int(match.group(1)) if match else default


def safe_component(text: str, limit: int = 128) -> str:
    """``text`` made safe as one path component: no separators, no leading dot."""
    cleaned = _UNSAFE.sub("_", text)[:limit].lstrip(".")
    return cleaned or "_"


def detect(env: Mapping[str, str] | None = None) -> Identity:
    """Read the identity from ``env`` (default ``os.environ``)."""
    env = os.environ if env is None else env
    pid = os.getpid()
    host = socket.gethostname() or "localhost"
    for name, proof, rank, local_rank, world, local_world, node, restart, job in _LAUNCHERS:
        if proof not in env:
            continue
        world_size = max(1, _int(env, world, 1))
        run_id = env.get("TORCHELASTIC_RUN_ID") or None
        job_id = env.get(job, "") if job else ""
        if job_id in ("", "none"):
            job_id = _fallback_job_id(env)
        return Identity(
            job_id=job_id,
            rank=_int(env, rank, 0),
            world_size=world_size,
            local_rank=_int(env, local_rank, 0),
            local_world_size=max(1, _int(env, local_world, world_size)),
            node_rank=_int(env, node, 0),
            restart_count=_int(env, restart, 0),
            host=host,
            pid=pid,
            run_id=run_id,
            launcher=name,
        )
    return Identity(
        job_id=_fallback_job_id(env),
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        node_rank=0,
        restart_count=0,
        host=host,
        pid=pid,
    )


def _fallback_job_id(env: Mapping[str, str]) -> str:
    """A job id every rank of one job agrees on, when no launcher names the job."""
    port = env.get("MASTER_PORT")
    if port:
        return f"job-{env.get('MASTER_ADDR', 'localhost')}-{port}"
    return time.strftime("job-%Y%m%d-%H%M%S") + f"-{os.getpid()}"
