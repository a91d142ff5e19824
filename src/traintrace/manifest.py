"""The job folder: a manifest written once, and one registration per rank start.

Layout (``<log_dir>/<job>/``)::

    manifest.json                  written once, by the launcher's agent or rank 0
    agent.jsonl                    the agent's stream (traintrace-run), if any
    rank0.jsonl, rank1.jsonl ...   one stream per rank (restarts append)
    ranks/rank1.restart0.json      one registration per rank and restart

The manifest says what to expect (job id, world size, start time, the
configuration, the library version, the launcher's settings); each rank adds
its own registration (host, pid, restart, its stream's path) when it starts,
so the host list grows as ranks register and a reader can name the ranks that
never started: :func:`read_job`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._config import Config
    from ._identity import Identity

__all__ = ["MANIFEST_NAME", "JobInfo", "read_job", "write_manifest", "write_registration"]

log = logging.getLogger("traintrace.lib")

MANIFEST_NAME = "manifest.json"
MANIFEST_SCHEMA = "traintrace-manifest"


def _atomic_write(path: Path, payload: dict[str, Any], *, once: bool, mode: int = 0o640) -> bool:
    """Write JSON to ``path`` completely or not at all; with ``once``, never replace it.

    Folders are created with :func:`dir_mode` of ``mode``; nothing is written
    through a link planted in the folder (``_safefs.atomic_write_at``).
    """
    from ._safefs import atomic_write_at, dir_mode, make_dirs, open_dir

    make_dirs(path.parent, dir_mode(mode))
    data = (json.dumps(payload, indent=2, sort_keys=True, default=repr) + "\n").encode("utf-8")
    fd = open_dir(path.parent, follow=False)  # the job folder (or ranks/) may not be a link
    try:
        return atomic_write_at(fd, path.name, data, mode, once=once)
    finally:
        os.close(fd)


def _file_mode(config: Config) -> int:
    """The stream files' permissions, for the manifest and registrations too (default 0o640)."""
    mode = getattr(config.backends.get("file"), "file_mode", 0o640)
    return mode if isinstance(mode, int) and 0 <= mode <= 0o777 else 0o640


def _strip_userinfo(url: object) -> object:
    """``https://user:secret@host`` without its credentials."""
    if isinstance(url, str) and "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        host, sep, path = rest.partition("/")
        if "@" in host:
            return f"{scheme}://<redacted>@{host.rsplit('@', 1)[1]}{sep}{path}"
    return url


def _config_dict(config: Config) -> dict[str, Any]:
    """The configuration as the manifest shows it: secrets redacted, exporter headers never written."""
    from ._redact import REDACTED, Redactor
    from ._sanitize import convert_mapping

    data = dataclasses.asdict(config)
    backends: dict[str, Any] = {}
    for name, cfg in config.backends.items():
        fields = dataclasses.asdict(cfg)
        if fields.get("headers"):
            # Exporter headers carry tokens (authorization: Bearer ...): their names only.
            given = fields["headers"]
            fields["headers"] = {str(k): REDACTED for k in given} if isinstance(given, Mapping) else REDACTED
        if "endpoint" in fields:
            fields["endpoint"] = _strip_userinfo(fields["endpoint"])
        backends[name] = {"type": type(cfg).type, **fields}
    data["backends"] = backends
    redactor = Redactor(config.redact_keys if isinstance(config.redact_keys, list | tuple) else ())
    return convert_mapping(data, redactor.secret if redactor else None)


def job_dir(config: Config, identity: Identity) -> Path:
    from ._identity import safe_component

    return Path(config.log_dir) / safe_component(identity.job_id)


def write_manifest(
    folder: Path,
    config: Config,
    identity: Identity,
    *,
    created_by: str,
    launch: Mapping[str, Any] | None = None,
) -> bool:
    """Write ``manifest.json`` unless it exists; True if this call wrote it."""
    from ._version import __version__

    now = time.time_ns()
    payload: dict[str, Any] = {
        "schema": MANIFEST_SCHEMA,
        "schema_version": 1,
        "job": identity.job_id,
        "job_name": config.job_name,
        "run": identity.run_id,
        "world_size": identity.world_size,
        "created_ns": now,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now / 1e9)),
        "created_by": created_by,
        "launcher": identity.launcher,
        "library_version": __version__,
        "hosts": [identity.host],
        "config": _config_dict(config),
        "streams": {"rank": "rank{rank}.jsonl", "agent": "agent*.jsonl", "registrations": "ranks/"},
    }
    if launch:
        payload["launch"] = dict(launch)
        world = launch.get("world_size")
        if isinstance(world, int):
            payload["world_size"] = world
    return _atomic_write(folder / MANIFEST_NAME, payload, once=True, mode=_file_mode(config))


def write_registration(
    folder: Path, identity: Identity, stream: str | None, *, mode: int = 0o640, **extra: Any
) -> Path:
    """Record that this rank started (or restarted); returns the registration's path."""
    fields = identity.to_dict()
    del fields["job"]
    payload: dict[str, Any] = {
        **fields,
        "launcher": identity.launcher,
        "registered_ns": time.time_ns(),
        "stream": stream,
        **extra,
    }
    path = folder / "ranks" / f"rank{identity.rank}.restart{identity.restart_count}.json"
    _atomic_write(path, payload, once=False, mode=mode)
    return path


@dataclass
class JobInfo:
    """What a job folder says about the job: see :func:`read_job`."""

    folder: str
    manifest: dict[str, Any] | None
    registrations: list[dict[str, Any]] = field(default_factory=list)

    @property
    def world_size(self) -> int | None:
        sizes = [int(r["world_size"]) for r in self.registrations if isinstance(r.get("world_size"), int)]
        if self.manifest and isinstance(self.manifest.get("world_size"), int):
            sizes.append(int(self.manifest["world_size"]))
        return max(sizes) if sizes else None

    @property
    def hosts(self) -> list[str]:
        hosts = {str(r["host"]) for r in self.registrations if r.get("host")}
        if not self.registrations and self.manifest:
            hosts.update(str(h) for h in self.manifest.get("hosts", []))
        return sorted(hosts)

    @property
    def restarts(self) -> int:
        """The highest restart count any rank registered with."""
        return max((int(r.get("restart", 0)) for r in self.registrations), default=0)

    def ranks(self, restart: int | None = None) -> list[int]:
        """Ranks that registered (in ``restart``, default the latest)."""
        wanted = self.restarts if restart is None else restart
        return sorted({int(r["rank"]) for r in self.registrations if r.get("restart", 0) == wanted})

    def missing_ranks(self, restart: int | None = None) -> list[int]:
        """Ranks below the world size that did not register (in ``restart``, default the latest)."""
        world = self.world_size
        if world is None:
            return []
        seen = set(self.ranks(restart))
        return [rank for rank in range(world) if rank not in seen]


def read_job(folder: str | os.PathLike[str]) -> JobInfo:
    """Read a job folder's manifest and registrations. Never raises on bad content."""
    root = Path(folder)
    manifest: dict[str, Any] | None = None
    try:
        loaded = json.loads((root / MANIFEST_NAME).read_text(encoding="utf-8"))
        manifest = loaded if isinstance(loaded, dict) else None
    except (OSError, ValueError):
        manifest = None
    info = JobInfo(str(root), manifest)
    registrations = root / "ranks"
    if registrations.is_dir():
        for path in sorted(registrations.glob("rank*.json")):
            try:
                item = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(item, dict) and isinstance(item.get("rank"), int):
                info.registrations.append(item)
    return info
