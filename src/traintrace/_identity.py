"""Who is recording: rank, world size, host and job, read from the environment.

No torch import: launchers put everything in environment variables. The
precedence, highest first (docs/distributed.md):

1. explicit configuration (``configure(rank=...)``, ``TRAINTRACE_RANK`` ...);
2. ``torch.distributed`` (or ``jax.distributed``) once a process group
   exists, applied by :func:`traintrace.refresh_identity` and at the end of a
   ``distributed_init`` span;
3. the first launcher whose variables are present, in the order of
   ``_LAUNCHERS``: torchrun/torchelastic, SLURM, Open MPI, PMI (MPICH, Intel
   MPI), then bare ``RANK``/``WORLD_SIZE``;
4. a single process: rank 0 of 1.

The job id comes from, highest first: configuration, the torchelastic run id
(unless it is torchrun's default ``"none"``), the batch scheduler's job id
(SLURM, PBS, LSF, Flux), the MPI job, ``MASTER_ADDR``/``MASTER_PORT``, and
last a generated one.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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

    def to_dict(self) -> dict[str, Any]:
        """The identity as records spell it (``job``, ``restart``): the header's fields, in its order."""
        return {
            "job": self.job_id,
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "local_world_size": self.local_world_size,
            "node_rank": self.node_rank,
            "restart": self.restart_count,
            "host": self.host,
            "pid": self.pid,
        }


@dataclass(frozen=True)
class _Launcher:
    name: str
    proof: str
    rank: str
    local_rank: str
    world_size: str
    local_world_size: str
    node_rank: str
    restart: str
    job: tuple[str, ...]


# Earlier entries win: torchrun under SLURM sets both, and the SLURM variables
# then describe the launcher task, not the worker.
_LAUNCHERS: tuple[_Launcher, ...] = (
    _Launcher(
        "torchelastic",
        "TORCHELASTIC_RUN_ID",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "TORCHELASTIC_RESTART_COUNT",
        ("TORCHELASTIC_RUN_ID",),
    ),
    _Launcher(
        "slurm",
        "SLURM_PROCID",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_NTASKS",
        "",  # from SLURM_TASKS_PER_NODE, see _slurm_local_world_size
        "SLURM_NODEID",
        "SLURM_RESTART_COUNT",
        (),
    ),
    _Launcher(
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "OMPI_COMM_WORLD_NODE_RANK",
        "",
        ("OMPI_MCA_orte_ess_jobid", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"),
    ),
    _Launcher(
        "pmi",
        "PMI_RANK",
        "PMI_RANK",
        "MPI_LOCALRANKID",
        "PMI_SIZE",
        "MPI_LOCALNRANKS",
        "",
        "",
        ("PMIX_NAMESPACE",),
    ),
    _Launcher("env", "RANK", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "", ()),
)

#: Batch schedulers' job ids, tried after the launcher's own job variable.
_SCHEDULER_JOB_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID")


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    if not name:
        return default
    raw = env.get(name, "")
    # SLURM writes counts like "4(x2)"; the leading number is the one that matters.
    match = re.match(r"\s*(-?\d+)", raw)
    return int(match.group(1)) if match else default


def safe_component(text: str, limit: int = 128) -> str:
    """``text`` made safe as one path component: no separators, no leading dot.

    When that changed it (characters replaced, a leading dot removed, a cut at
    ``limit``), a short hash of the original is added, so ids that differ only
    there (``a/b``, ``a\x00b``, ``a_b``; long ids sharing a prefix) keep
    different folders: ``a/b`` -> ``a_b-<8 hex digits>``.
    """
    cleaned = _UNSAFE.sub("_", text).lstrip(".")
    if cleaned == text and 0 < len(text) <= limit:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{cleaned[: max(limit - 9, 1)] or '_'}-{digest}"


def expand_slurm_counts(spec: str) -> list[int]:
    """SLURM's compressed per-node counts (``"2(x3),1"``) as a list (``[2, 2, 2, 1]``)."""
    out: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            return []
        out.extend([int(match.group(1))] * int(match.group(2) or 1))
    return out


def _slurm_local_world_size(env: Mapping[str, str], node: int, default: int) -> int:
    spec = env.get("SLURM_TASKS_PER_NODE", "") or env.get("SLURM_STEP_TASKS_PER_NODE", "")
    counts = expand_slurm_counts(spec)
    if 0 <= node < len(counts):
        return counts[node]
    return _int(env, "SLURM_NTASKS_PER_NODE", default)


def scheduler_job_id(env: Mapping[str, str]) -> str:
    """The batch scheduler's job id, or "" outside one. Array jobs give ``<array>_<task>``."""
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    for name in _SCHEDULER_JOB_VARS:
        value = env.get(name, "").strip()
        if value:
            return value
    return ""


def detect(env: Mapping[str, str] | None = None) -> Identity:
    """Read the identity from ``env`` (default ``os.environ``)."""
    env = os.environ if env is None else env
    pid = os.getpid()
    host = socket.gethostname() or "localhost"
    for launcher in _LAUNCHERS:
        if launcher.proof not in env:
            continue
        world_size = max(1, _int(env, launcher.world_size, 1))
        rank = _int(env, launcher.rank, 0)
        node_rank = max(0, _int(env, launcher.node_rank, 0))
        if launcher.name == "slurm":
            local_world_size = _slurm_local_world_size(env, node_rank, world_size)
        else:
            local_world_size = _int(env, launcher.local_world_size, world_size)
        run_id = env.get("TORCHELASTIC_RUN_ID") or None
        return Identity(
            job_id=job_id_from(env, launcher.job),
            rank=rank,
            world_size=world_size,
            local_rank=max(0, _int(env, launcher.local_rank, 0)),
            local_world_size=max(1, local_world_size),
            node_rank=node_rank,
            restart_count=max(0, _int(env, launcher.restart, 0)),
            host=host,
            pid=pid,
            run_id=run_id if run_id != "none" else None,
            launcher=launcher.name,
        )
    return Identity(
        job_id=job_id_from(env, ()),
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        node_rank=0,
        restart_count=0,
        host=host,
        pid=pid,
    )


def job_id_from(env: Mapping[str, str], launcher_vars: tuple[str, ...] = ()) -> str:
    """The job id from the launcher's variables, the scheduler, or a fallback."""
    for name in launcher_vars:
        value = env.get(name, "").strip()
        if value and value != "none":
            return value
    return scheduler_job_id(env) or _fallback_job_id(env)


def _fallback_job_id(env: Mapping[str, str]) -> str:
    """A job id every rank of one job agrees on, when no launcher names the job."""
    port = env.get("MASTER_PORT")
    if port:
        return f"job-{env.get('MASTER_ADDR', 'localhost')}-{port}"
    return time.strftime("job-%Y%m%d-%H%M%S") + f"-{os.getpid()}"


def distributed_view() -> tuple[int, int, str] | None:
    """(rank, world size, source) from an initialised torch or JAX process group.

    Imports nothing: a framework that the program has not imported is not
    asked. Never raises.
    """
    dist: Any = sys.modules.get("torch.distributed")
    if dist is not None:
        try:
            if dist.is_available() and dist.is_initialized():
                return int(dist.get_rank()), int(dist.get_world_size()), "torch.distributed"
        except Exception:  # noqa: BLE001 - a broken process group must not break telemetry
            pass
    jax: Any = sys.modules.get("jax")
    if jax is not None:
        try:
            # Asking JAX for its process index before jax.distributed.initialize()
            # would start the backends and make initialize() fail later: ask only
            # once it reports that it is initialised.
            is_initialized = getattr(getattr(jax, "distributed", None), "is_initialized", None)
            if callable(is_initialized) and is_initialized():
                return int(jax.process_index()), int(jax.process_count()), "jax.distributed"
        except Exception:  # noqa: BLE001
            pass
    return None
