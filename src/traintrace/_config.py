"""Configuration: dataclasses, a TOML/YAML file and ``TRAINTRACE_*`` variables.

Precedence, lowest first: defaults < configuration file < ``configure()``
keyword arguments < ``TRAINTRACE_*`` environment variables. The environment
wins so that an operator can change a job's telemetry without editing code.
"""

from __future__ import annotations

import builtins
import dataclasses
import math
import os
import string
import sys
import time
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from .backends._base import Backend

from ._identity import Identity, safe_component
from ._names import Verbosity
from ._redact import DEFAULT_REDACT_KEYS

ENV_PREFIX = "TRAINTRACE_"


class ConfigError(ValueError):
    """Raised by ``configure()`` for a bad setting; the message names the field."""


#: The largest world size accepted (and so the most ranks a selector can name).
MAX_WORLD_SIZE = 1 << 20
_MAX_SELECTOR = 4096


def _selector_parts(spec: object) -> list[str] | None:
    """A selector's parts (``None``: all ranks); raises ValueError/TypeError if it is not one."""
    if isinstance(spec, bool):
        raise ValueError(f"not a rank selector: {spec!r}")
    if isinstance(spec, int):
        return [str(spec)]
    if isinstance(spec, str):
        if len(spec) > _MAX_SELECTOR:
            raise ValueError(f"rank selector longer than {_MAX_SELECTOR} characters")
        text = spec.strip().lower()
        if text in ("all", "*", ""):
            return None
        if text == "none":
            return []
        return [p.strip() for p in text.split(",") if p.strip()]
    if isinstance(spec, Sequence):
        if len(spec) > _MAX_SELECTOR:
            raise ValueError(f"rank selector with more than {_MAX_SELECTOR} ranks")
        return [str(int(p)) for p in spec]
    raise ValueError(f"not a rank selector: {spec!r}")


def _part_bounds(part: str, world_size: int) -> tuple[int, int]:
    """The inclusive rank range one part names (may be empty: low > high)."""
    if part == "last":
        return world_size - 1, world_size - 1
    if "-" in part[1:]:
        low, high = part.split("-", 1) if not part.startswith("-") else (part, "")
        return int(low), int(high)
    value = int(part)
    value = value + world_size if value < 0 else value
    return value, value


def rank_selected(spec: object, rank: int, world_size: int) -> bool:
    """Whether the selector ``spec`` names ``rank``, without listing every rank it names."""
    parts = _selector_parts(spec)
    if parts is None:
        return 0 <= rank < world_size
    for part in parts:
        low, high = _part_bounds(part, world_size)
        if low <= rank <= high:
            return True
    return False


def parse_ranks(spec: object, world_size: int) -> frozenset[int]:
    """The ranks below ``world_size`` a selector names.

    ``"all"``, ``"none"``, ``"last"``, an int (negative counts from the end),
    ``"0,2,5"``, ``"0-3"``, or a sequence of ints. Ranges are cut at the world
    size, so ``"0-99999999"`` costs what the world has, not 1e8 entries.
    """
    parts = _selector_parts(spec)
    if parts is None:
        return frozenset(range(world_size))
    ranks: set[int] = set()
    for part in parts:
        low, high = _part_bounds(part, world_size)
        ranks.update(range(max(low, 0), min(high, world_size - 1) + 1))
    return frozenset(ranks)


def _seconds(name: str, value: object, *, low: float, high: float, zero_off: bool = False) -> None:
    """ConfigError unless ``value`` is a finite number of seconds in [low, high] (or 0 when ``zero_off``)."""
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if ok and (low <= value <= high or (zero_off and value == 0)):  # type: ignore[operator]
        return
    off = " (0 turns it off)" if zero_off else ""
    raise ConfigError(f"{name}: expected a number of seconds from {low:g} to {high:g}{off}, got {value!r}")


#: Intervals: at least a millisecond (no busy loop), at most a day; timeouts: at most 30 days.
_DAY = 86400.0
_MONTH = 30 * _DAY


@dataclass
class BackendConfig:
    """Fields every backend shares.

    ``ranks`` picks the ranks where the backend runs at ``verbosity``; on the
    other ranks it runs at ``verbosity_elsewhere``, or not at all when that is
    ``None`` (e.g. logs at ``info`` on rank 0 and only errors elsewhere).
    """

    type: ClassVar[str] = ""
    registry: ClassVar[dict[str, builtins.type[BackendConfig]]] = {}

    enabled: bool = True
    verbosity: Verbosity | str | int = Verbosity.INFO
    ranks: str | int | Sequence[int] = "all"
    verbosity_elsewhere: Verbosity | str | int | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.type:
            BackendConfig.registry[cls.type] = cls

    def effective_verbosity(self, rank: int, world_size: int) -> Verbosity | None:
        """The level this backend runs at on ``rank``, or None where it is off."""
        if not self.enabled:
            return None
        if rank_selected(self.ranks, rank, world_size):
            return Verbosity.parse(self.verbosity)
        if self.verbosity_elsewhere is None:
            return None
        return Verbosity.parse(self.verbosity_elsewhere)

    def validate(self, where: str) -> None:
        """Raise ConfigError for a bad field; normalise what is good."""
        try:
            self.verbosity = Verbosity.parse(self.verbosity)
        except ValueError as exc:
            raise ConfigError(f"{where}.verbosity: {exc}") from None
        if self.verbosity_elsewhere is not None:
            try:
                self.verbosity_elsewhere = Verbosity.parse(self.verbosity_elsewhere)
            except ValueError as exc:
                raise ConfigError(f"{where}.verbosity_elsewhere: {exc}") from None
        try:
            rank_selected(self.ranks, 0, 1)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{where}.ranks: {exc} (use 'all', 'none', 'last', 3, -1, '0,2', '0-3')") from None
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"{where}.enabled: expected true or false, got {self.enabled!r}")

    def create(self, config: Config, identity: Identity, level: int) -> Backend:
        """The backend this config describes, at ``level``, for the process ``identity`` names."""
        raise ConfigError(f"backends.{self.type}: {type(self).__name__} has no create(config, identity, level)")


@dataclass
class FileBackendConfig(BackendConfig):
    """JSON-lines files, one stream per process.

    ``path`` is a template, relative to ``Config.log_dir`` unless absolute, with
    the placeholders ``{job}``, ``{rank}``, ``{local_rank}``, ``{node}``,
    ``{world_size}``, ``{restart}``, ``{host}``, ``{pid}``, ``{date}``
    (YYYYmmdd) and ``{time}`` (HHMMSS). Substituted values are made safe as
    path components, and a relative path must stay inside ``log_dir``.
    """

    type: ClassVar[str] = "file"
    path: str = "{job}/rank{rank}.jsonl"
    verbosity: Verbosity | str | int = Verbosity.PROFILING
    file_mode: int = 0o640
    fsync_on_close: bool = True
    #: Bytes set aside in a hidden sibling file for when the file system fills up (0: none).
    reserve_bytes: int = 128 * 1024

    def validate(self, where: str) -> None:
        super().validate(where)
        if isinstance(self.reserve_bytes, bool) or not isinstance(self.reserve_bytes, int) or self.reserve_bytes < 0:
            raise ConfigError(f"{where}.reserve_bytes: expected a number of bytes, 0 or more (0: no reserve)")
        if not isinstance(self.path, str) or not self.path.strip():
            raise ConfigError(f"{where}.path: expected a non-empty path template")
        if "\x00" in self.path:
            raise ConfigError(f"{where}.path: a NUL character cannot be in a path")
        try:
            list(string.Formatter().parse(self.path))
        except ValueError as exc:
            raise ConfigError(f"{where}.path: {exc} (write {{{{ and }}}} for a literal brace)") from None
        if not isinstance(self.file_mode, int) or not 0 <= self.file_mode <= 0o777:
            raise ConfigError(f"{where}.file_mode: expected permission bits like 0o640")

    def create(self, config: Config, identity: Identity, level: int) -> Backend:
        from .backends._file import FileBackend

        path = resolve_path(self.path, config.log_dir, identity)
        return FileBackend(
            path,
            verbosity=level,
            file_mode=self.file_mode,
            fsync_on_close=self.fsync_on_close,
            reserve_bytes=self.reserve_bytes,
        )


@dataclass
class LogBackendConfig(BackendConfig):
    """Records as key=value (or JSON) lines through a ``logging`` logger.

    Default: ``info`` on rank 0, errors from every other rank.
    """

    type: ClassVar[str] = "log"
    logger: str = "traintrace.records"
    format: str = "kv"
    ranks: str | int | Sequence[int] = "0"
    verbosity_elsewhere: Verbosity | str | int | None = Verbosity.ERROR
    #: Put an error's whole stack in its log line (off: the stack is in the file; the line says where).
    stacks: bool = False

    def validate(self, where: str) -> None:
        super().validate(where)
        if not isinstance(self.stacks, bool):
            raise ConfigError(f"{where}.stacks: expected true or false, got {self.stacks!r}")
        if self.format not in ("kv", "json"):
            raise ConfigError(f"{where}.format: expected 'kv' or 'json', got {self.format!r}")
        if not isinstance(self.logger, str) or not self.logger:
            raise ConfigError(f"{where}.logger: expected a logger name")

    def create(self, config: Config, identity: Identity, level: int) -> Backend:
        from .backends._log import LogBackend

        return LogBackend(self.logger, format=self.format, verbosity=level, stacks=self.stacks)


# ---------------------------------------------------------------- path templates

_PLACEHOLDERS = ("job", "rank", "local_rank", "node", "world_size", "restart", "host", "pid", "date", "time")


def resolve_path(template: str, log_dir: str | os.PathLike[str], identity: Identity) -> Path:
    """The file a path template names for ``identity``; raises ConfigError if unsafe."""
    now = time.localtime()
    values = {
        "job": safe_component(identity.job_id),
        "rank": str(identity.rank),
        "local_rank": str(identity.local_rank),
        "node": str(identity.node_rank),
        "world_size": str(identity.world_size),
        "restart": str(identity.restart_count),
        "host": safe_component(identity.host),
        "pid": str(identity.pid),
        "date": time.strftime("%Y%m%d", now),
        "time": time.strftime("%H%M%S", now),
    }
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(template)]
    except ValueError as exc:
        raise ConfigError(f"backends.file.path: {exc}") from None
    for field_name in fields:
        if field_name is not None and field_name not in values:
            raise ConfigError(
                f"backends.file.path: unknown placeholder {{{field_name}}} "
                f"(known: {', '.join('{' + p + '}' for p in _PLACEHOLDERS)})"
            )
    try:
        rendered = template.format(**values)
    except (ValueError, IndexError) as exc:
        raise ConfigError(f"backends.file.path: {exc}") from None
    if "\x00" in rendered or "\x00" in os.fspath(log_dir):
        raise ConfigError("backends.file.path: a NUL character cannot be in a path")
    path = Path(rendered)
    if rendered.endswith(("/", os.sep)) or path.name in ("", ".", ".."):
        raise ConfigError(f"backends.file.path: {template!r} names a folder, not a file")
    if path.is_absolute():
        return path
    root = Path(log_dir).resolve()
    full = (root / path).resolve()
    if not full.is_relative_to(root):
        raise ConfigError(f"backends.file.path: {template!r} leaves the log folder {root}")
    return full


def _default_backends() -> dict[str, BackendConfig]:
    from ._console import ConsoleBackendConfig  # on when stderr is a terminal (docs/integrations/console.md)

    return {"file": FileBackendConfig(), "log": LogBackendConfig(), "console": ConsoleBackendConfig()}


@dataclass
class Config:
    """Everything ``configure()`` accepts. Unset identity fields are detected."""

    job_id: str | None = None
    job_name: str | None = None
    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    node_rank: int | None = None
    restart_count: int | None = None
    host: str | None = None
    log_dir: str = "traintrace_logs"
    backends: dict[str, BackendConfig] = field(default_factory=_default_backends)
    queue_size: int = 65536
    flush_interval: float = 0.5
    #: Niceness the writer thread adds to its own (Linux; 0 leaves it): on a machine whose cores are all
    #: busy it then waits for a core rather than taking the training thread's (docs/configuration.md).
    writer_nice: int = 3
    #: Keep the writer thread off the core the training thread is on (Linux, with another core allowed):
    #: on a machine whose cores are all busy it then takes its time from the others (docs/configuration.md).
    writer_spare_core: bool = True
    blocking: bool = False
    close_timeout: float = 5.0
    handle_sigterm: bool = True
    fork: str = "quiet"
    log_interval: int = 100
    metadata: dict[str, Any] = field(default_factory=dict)
    #: Write <log_dir>/<job>/manifest.json and a registration per rank (docs/distributed.md).
    manifest: bool = True
    # Training-loop insight (docs/insight.md).
    statistics: bool = True
    peak_tflops: float | None = None
    accelerator: str | None = None
    device_sample_interval: float = 10.0
    hang_timeout: float = 600.0
    hang_check_interval: float = 5.0
    hang_exit_after: float | None = None
    hang_exit_code: int = 86
    phase_timeouts: dict[str, float] = field(default_factory=dict)
    #: Metric/attribute keys whose values are written as "<redacted>" (docs/reliability.md).
    redact_keys: list[str] = field(default_factory=lambda: list(DEFAULT_REDACT_KEYS))
    #: On a fatal signal (segfault, abort), Python stacks go to ``<stream>.faults.txt``.
    fault_handler: bool = True
    #: Keep ``rankN.progress`` beside the stream: step and phase, kept through a kill (docs/format.md).
    progress_file: bool = True
    #: Device (GPU) time of phases from CUDA events: "auto" (when CUDA is initialised), true, false
    #: (docs/configuration.md, "Device timing").
    device_timing: str | bool = "auto"
    #: The spans timed on the device (empty: the standard phases).
    device_timing_phases: list[str] = field(default_factory=list)
    #: Seconds a span's record waits for its device events before it is written without them.
    device_timing_timeout: float = 10.0

    def validate(self) -> None:
        """Raise ConfigError naming the first bad field."""
        for name in ("rank", "world_size", "local_rank", "local_world_size", "node_rank"):
            _check_int(name, getattr(self, name), minimum=0, optional=True)
        _check_int("restart_count", self.restart_count, minimum=0, optional=True)
        if self.world_size is not None and not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise ConfigError(f"world_size: must be from 1 to {MAX_WORLD_SIZE}, got {self.world_size}")
        if self.local_world_size is not None and self.local_world_size > MAX_WORLD_SIZE:
            raise ConfigError(f"local_world_size: must be at most {MAX_WORLD_SIZE}")
        if self.rank is not None and self.world_size is not None and self.rank >= self.world_size:
            raise ConfigError(f"rank: {self.rank} is not below world_size {self.world_size}")
        _check_int("queue_size", self.queue_size, minimum=16)
        _check_int("log_interval", self.log_interval, minimum=1)
        _seconds("flush_interval", self.flush_interval, low=0.001, high=_DAY)
        _check_int("writer_nice", self.writer_nice, minimum=0)
        if self.writer_nice > 19:
            raise ConfigError(
                f"writer_nice: must be from 0 to 19 (0 leaves the writer's priority), got {self.writer_nice}"
            )
        _seconds("close_timeout", self.close_timeout, low=0.001, high=_DAY)
        if self.fork not in ("quiet", "own_stream"):
            raise ConfigError(f"fork: expected 'quiet' or 'own_stream', got {self.fork!r}")
        if not isinstance(self.redact_keys, list | tuple) or not all(isinstance(k, str) for k in self.redact_keys):
            raise ConfigError(f"redact_keys: expected a list of key names, got {self.redact_keys!r}")
        for name in ("blocking", "handle_sigterm", "manifest", "fault_handler", "progress_file", "writer_spare_core"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: expected true or false")
        for name in ("job_id", "job_name", "host"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"{name}: expected a non-empty string, got {value!r}")
        if not isinstance(self.log_dir, str | os.PathLike):
            raise ConfigError(f"log_dir: expected a path, got {self.log_dir!r}")
        if "\x00" in os.fspath(self.log_dir):
            raise ConfigError("log_dir: a NUL character cannot be in a path")
        if not isinstance(self.metadata, dict):
            raise ConfigError("metadata: expected a mapping")
        for key, backend in self.backends.items():
            backend.validate(f"backends.{key}")
        _validate_insight(self)
        _validate_device_timing(self)


def _validate_device_timing(config: Config) -> None:
    """Normalise ``device_timing`` to "auto", True or False; raise ConfigError for a bad value."""
    value = config.device_timing
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            value = "auto"
        elif text in ("1", "true", "yes", "on"):
            value = True
        elif text in ("0", "false", "no", "off"):
            value = False
    if value not in ("auto", True, False) or (isinstance(value, int) and not isinstance(value, bool)):
        raise ConfigError(f"device_timing: expected 'auto', true or false, got {config.device_timing!r}")
    config.device_timing = value
    phases = config.device_timing_phases
    if not isinstance(phases, list | tuple) or not all(isinstance(p, str) and p for p in phases):
        raise ConfigError(f"device_timing_phases: expected a list of span names, got {phases!r}")
    if not phases:
        from ._device_timing import DEFAULT_PHASES

        config.device_timing_phases = list(DEFAULT_PHASES)
    _seconds("device_timing_timeout", config.device_timing_timeout, low=0.001, high=_DAY)


def _validate_insight(config: Config) -> None:
    """Raise ConfigError for a bad training-loop insight setting (docs/insight.md)."""
    peak = config.peak_tflops
    if peak is not None and (
        isinstance(peak, bool) or not isinstance(peak, int | float) or not math.isfinite(peak) or peak <= 0
    ):
        raise ConfigError(f"peak_tflops: expected a positive number, got {peak!r}")
    _seconds("device_sample_interval", config.device_sample_interval, low=0.01, high=_DAY, zero_off=True)
    _seconds("hang_timeout", config.hang_timeout, low=0.001, high=_MONTH, zero_off=True)
    _seconds("hang_check_interval", config.hang_check_interval, low=0.01, high=_DAY)
    if config.hang_exit_after is not None:
        _seconds("hang_exit_after", config.hang_exit_after, low=0.001, high=_MONTH)
    code = config.hang_exit_code
    if isinstance(code, bool) or not isinstance(code, int) or not 1 <= code <= 255:
        raise ConfigError(f"hang_exit_code: expected an exit status from 1 to 255, got {code!r}")
    if not isinstance(config.statistics, bool):
        raise ConfigError(f"statistics: expected true or false, got {config.statistics!r}")
    if config.accelerator is not None and not isinstance(config.accelerator, str):
        raise ConfigError(f"accelerator: expected a device name, got {config.accelerator!r}")
    timeouts = config.phase_timeouts
    if isinstance(timeouts, str):
        # From the environment: "checkpoint_save_sync=3600,validation_loop=7200".
        parsed: dict[str, float] = {}
        for part in timeouts.split(","):
            if not part.strip():
                continue
            name, sep, seconds = part.partition("=")
            try:
                parsed[name.strip()] = float(seconds)
            except ValueError:
                sep = ""
            if not sep:
                raise ConfigError(f"phase_timeouts: expected name=seconds pairs, got {part!r}") from None
        timeouts = config.phase_timeouts = parsed
    if not isinstance(timeouts, Mapping):
        raise ConfigError("phase_timeouts: expected a mapping of span name to seconds")
    for name, seconds in timeouts.items():
        _seconds(f"phase_timeouts.{name}", seconds, low=0.001, high=_MONTH)


def disabled(env: Mapping[str, str] | None = None) -> bool:
    """True when ``TRAINTRACE_DISABLED`` turns recording off (``1``, ``true``, ``yes``)."""
    value = (os.environ if env is None else env).get(ENV_PREFIX + "DISABLED", "")
    return value.lower() in ("1", "true", "yes")


def _check_int(name: str, value: object, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name}: must be at least {minimum}, got {value}")


# ---------------------------------------------------------------- merging


def _coerce(annotation: Any, raw: Any, where: str) -> Any:
    """Convert a string from the environment (or a file value) to a field's type."""
    if not isinstance(raw, str):
        return raw
    text = raw.strip()
    kinds = _annotation_kinds(annotation)
    if "NoneType" in kinds and text.lower() in ("", "none", "null"):
        return None
    if "list" in kinds:
        return [part.strip() for part in text.split(",") if part.strip()]
    if "bool" in kinds:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        if "str" in kinds:  # a setting that is a word or a switch ("auto", true, false)
            return text
        raise ConfigError(f"{where}: expected true or false, got {raw!r}")
    if "int" in kinds and "str" not in kinds and "Verbosity" not in kinds:
        try:
            return int(text, 0)
        except ValueError:
            raise ConfigError(f"{where}: expected an integer, got {raw!r}") from None
    if "float" in kinds:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {raw!r}") from None
    return text


def _annotation_kinds(annotation: Any) -> set[str]:
    if isinstance(annotation, str):
        return {part.strip().split("[")[0] for part in annotation.split("|")} | (
            {"NoneType"} if "None" in annotation else set()
        )
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        out: set[str] = set()
        for arg in typing.get_args(annotation):
            out |= _annotation_kinds(arg)
        return out
    return {getattr(annotation, "__name__", str(annotation))}


def _fields(cls: type) -> dict[str, Any]:
    return {f.name: f.type for f in dataclasses.fields(cls)}


def _apply(target: Any, values: Mapping[str, Any], where: str) -> None:
    known = _fields(type(target))
    for key, value in values.items():
        name = key.lower()
        if name == "backends":
            _apply_backends(target, value, "backends")
            continue
        if name not in known:
            choices = ", ".join(sorted(known))
            raise ConfigError(f"{where}{name}: unknown setting (known: {choices})")
        setattr(target, name, _coerce(known[name], value, f"{where}{name}"))


def _apply_backends(config: Config, value: Any, where: str) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            name = str(key).lower()
            cls = BackendConfig.registry.get(name)
            if cls is None:
                choices = ", ".join(sorted(BackendConfig.registry))
                raise ConfigError(f"{where}.{name}: unknown backend type (known: {choices})")
            current = config.backends.get(name) or cls(enabled=True)
            if isinstance(item, BackendConfig):
                current = item
            elif isinstance(item, bool):
                current.enabled = item
            elif isinstance(item, Mapping):
                _apply(current, item, f"{where}.{name}.")
            else:
                raise ConfigError(f"{where}.{name}: expected a table of settings or true/false")
            config.backends[name] = current
        return
    if isinstance(value, Sequence) and not isinstance(value, str):
        chosen: dict[str, BackendConfig] = {}
        for item in value:
            if not isinstance(item, BackendConfig):
                raise ConfigError(
                    f"{where}: a list holds backend configs such as FileBackendConfig(); "
                    "pass backend objects with extra_backends="
                )
            chosen[item.type] = item
        config.backends = chosen
        return
    raise ConfigError(f"{where}: expected a mapping or a list of backend configs")


def _toml_module(file: Path) -> Any:
    """``tomllib`` (Python 3.11+), else ``tomli``; a ConfigError when neither exists."""
    try:
        import tomllib  # type: ignore[import-not-found,unused-ignore]

        return tomllib
    except ImportError:
        pass
    try:
        import tomli  # type: ignore[import-not-found,unused-ignore]

        return tomli
    except ImportError:
        raise ConfigError(
            f"config file {file}: TOML on Python {sys.version_info[0]}.{sys.version_info[1]} needs tomli "
            "(pip install 'traintrace[toml]'), or use YAML with PyYAML"
        ) from None


def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a TOML (or, with PyYAML installed, YAML) configuration file."""
    file = Path(path)
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"config file {file}: {exc.strerror or exc}") from None
    if file.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(
                f"config file {file}: YAML needs PyYAML (pip install 'traintrace[yaml]'), or use TOML"
            ) from None
        try:
            loaded = yaml.safe_load(data) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {file}: {exc}") from None
    else:
        toml = _toml_module(file)
        try:
            loaded = toml.loads(data.decode("utf-8"))
        except (toml.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {file}: {exc}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {file}: expected a table of settings at the top")
    return loaded.get("traintrace", loaded) if isinstance(loaded.get("traintrace"), dict) else loaded


#: ``TRAINTRACE_*`` variables that are not settings of the library: read by
#: ``configure()`` itself, by the ``traintrace`` command, or at import (``pure``: the
#: pure-Python recording core) (docs/configuration.md).
OWN_VARIABLES = frozenset(
    {"config", "disabled", "memory_limit", "reader", "cache_dir", "spark_master", "pure", "pure_build", "native_cflags"}
)


def _unknown_variable(key: str, candidates: Sequence[str]) -> None:
    """One warning per variable, naming the closest setting; never an error."""
    import difflib

    from ._recorder import warn_once

    name = key[len(ENV_PREFIX) :].lower()
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    hint = f"; did you mean {ENV_PREFIX}{close[0].upper()}?" if close else ""
    warn_once(f"env:{key}", f"{key} is not a setting; ignored{hint} (docs/configuration.md)")


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """The settings named by ``TRAINTRACE_*`` variables, as a nested mapping.

    ``TRAINTRACE_JOB_ID=x`` sets ``job_id``; ``TRAINTRACE_BACKENDS_FILE_PATH=p``
    sets ``backends.file.path``; ``TRAINTRACE_BACKENDS_LOG_ENABLED=0`` turns the
    log backend off. A variable that names no setting is ignored with one
    warning that names the closest setting (a typo must not stop recording).
    """
    top = {f.name for f in dataclasses.fields(Config)} - {"backends", "metadata"}
    out: dict[str, Any] = {}
    backends: dict[str, dict[str, Any]] = {}
    for key, value in env.items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name.startswith("backends_"):
            rest = name[len("backends_") :]
            for kind in sorted(BackendConfig.registry, key=len, reverse=True):
                if rest.startswith(kind + "_"):
                    fields = _fields(BackendConfig.registry[kind])
                    field_name = rest[len(kind) + 1 :]
                    if field_name in fields:
                        backends.setdefault(kind, {})[field_name] = value
                    else:
                        _unknown_variable(key, [f"backends_{kind}_{f}" for f in fields])
                    break
            else:
                _unknown_variable(
                    key,
                    [f"backends_{kind}_{f}" for kind, cls in BackendConfig.registry.items() for f in _fields(cls)],
                )
        elif name in top:
            out[name] = value
        elif name not in OWN_VARIABLES:
            _unknown_variable(key, sorted(top))
    if backends:
        out["backends"] = backends
    return out


def build_config(
    config: Config | None = None,
    *,
    config_file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> Config:
    """Merge defaults, file, arguments and environment into one validated Config."""
    env = os.environ if env is None else env
    result = Config()
    file_path = config_file or env.get(ENV_PREFIX + "CONFIG")
    if file_path:
        _apply(result, load_file(file_path), "")
    if config is not None:
        if not isinstance(config, Config):
            raise ConfigError("config: expected a traintrace.Config")
        for f in dataclasses.fields(Config):
            default = Config()
            value = getattr(config, f.name)
            if value != getattr(default, f.name):
                setattr(result, f.name, value)
    if kwargs:
        _apply(result, kwargs, "")
    _apply(result, env_overrides(env), "")
    result.validate()
    return result
