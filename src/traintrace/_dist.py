"""Distributed jobs: identity refresh from the process group, job-folder bookkeeping."""

from __future__ import annotations

import dataclasses
import logging
from types import TracebackType
from typing import Any

from ._config import disabled
from ._identity import Identity, distributed_view
from ._names import EventName, Verbosity
from ._recorder import Recorder, Span, get_active, warn_once

log = logging.getLogger("traintrace.lib")

#: The event recorded when the process group's view of the rank differs from the stream's.
IDENTITY_EVENT = EventName.IDENTITY


def refresh_identity() -> Identity | None:
    """Check the stream's rank and world size against an initialised process group.

    Asks ``torch.distributed`` (or ``jax.distributed``) only if the program
    already imported it and a process group exists. When it differs from
    what was detected at ``configure()`` and the rank or world size was not
    set explicitly, the recorder's identity is updated, an ``identity`` event
    records old and new values, and the rank registers again in the job
    folder. An explicit setting is kept, and the conflict is recorded. The
    stream's file name and header keep the values of ``configure()``: call
    ``configure()`` after ``init_process_group()`` where the environment
    does not name the rank. Returns the identity now in use (None before
    ``configure()``). Never raises.
    """
    rec = get_active()
    if rec is None:
        return None
    current = rec.identity
    try:
        view = distributed_view()
        if view is None or current is None:
            return current
        rank, world, source = view
        if (rank, world) == (current.rank, current.world_size):
            return current
        config = rec.config
        new_world = current.world_size if config.world_size is not None else world
        new_rank = current.rank if config.rank is not None or rank >= new_world else rank
        changed = (new_rank, new_world) != (current.rank, current.world_size)
        conflict = (new_rank, new_world) != (rank, world)
        if not changed and rec.identity_conflict_reported:
            return current
        rec.event(
            IDENTITY_EVENT,
            {
                "from": source,
                "rank": new_rank,
                "world_size": new_world,
                "detected_rank": rank,
                "detected_world_size": world,
                "previous_rank": current.rank,
                "previous_world_size": current.world_size,
                "applied": changed,
            },
            level=Verbosity.ERROR if conflict else Verbosity.INFO,
        )
        if conflict:
            rec.identity_conflict_reported = True
            warn_once(
                "identity_conflict",
                f"{source} says rank {rank} of {world}, the configuration says rank "
                f"{current.rank} of {current.world_size}; the configuration wins",
            )
        if not changed:
            return current
        updated = dataclasses.replace(current, rank=new_rank, world_size=new_world)
        rec.identity = updated
        from .events import invalidate_identity_cache

        invalidate_identity_cache()
        warn_once(
            "identity_changed",
            f"{source} says rank {rank} of {world} but this stream was opened as rank "
            f"{current.rank} of {current.world_size} from the environment; records now carry an "
            "'identity' event. Call configure() after init_process_group(), or pass rank= and "
            "world_size=, so that each rank writes its own file",
        )
        register(rec, updated)
        return updated
    except Exception:
        log.debug("traintrace: refresh_identity failed", exc_info=True)
        return current


class DistributedInitSpan(Span):
    """The ``distributed_init`` span: refreshes the identity when it ends."""

    __slots__ = ()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        super().__exit__(exc_type, exc, tb)
        if exc is None and self._rec is not None:
            refresh_identity()


# ---------------------------------------------------------------- job folder


def _files_enabled(rec: Recorder) -> bool:
    config = rec.config
    if not getattr(config, "manifest", True):
        return False
    if disabled():
        return False
    file_cfg = config.backends.get("file")
    return file_cfg is not None and bool(file_cfg.enabled)


def _stream_path(rec: Recorder) -> str | None:
    for route in rec.routes():
        path = getattr(route.backend, "path", None)
        if path is not None:
            return str(path)
    return None


def register(rec: Recorder, identity: Identity) -> None:
    """Write this process's registration (and the manifest, for rank 0 or the agent)."""
    if not _files_enabled(rec):
        return
    from .manifest import job_dir, write_manifest, write_registration

    try:
        folder = job_dir(rec.config, identity)
        header: dict[str, Any] = rec.header
        if header.get("role") == "agent":
            return  # traintrace-run writes the manifest with the workers' configuration
        if header.get("parent_pid") is not None:
            return  # a forked child's own stream: the rank is its parent's, registered already
        mode = getattr(rec.config.backends.get("file"), "file_mode", 0o640)
        write_registration(folder, identity, _stream_path(rec), mode=mode)
        if identity.rank == 0:
            write_manifest(folder, rec.config, identity, created_by="rank0")
    except Exception as exc:  # noqa: BLE001 - bookkeeping must not stop the job
        warn_once("manifest", f"could not write the job manifest or registration: {exc}")


def after_start(rec: Recorder) -> None:
    """Called by ``configure()`` once the recorder runs."""
    identity: Identity | None = getattr(rec, "identity", None)
    if identity is not None:
        register(rec, identity)
