"""Configuration: precedence, files, environment, validation, rank rules, paths."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

import traintrace as tt
from traintrace._config import build_config, env_overrides, parse_ranks
from traintrace._identity import detect, safe_component


def test_defaults() -> None:
    """With nothing given: files from every rank, logs at info on rank 0."""
    config = build_config(env={})
    assert set(config.backends) == {"file", "log", "console"}
    assert config.backends["console"].enabled is False  # on only when stderr is a terminal
    assert config.backends["file"].verbosity == tt.Verbosity.PROFILING
    assert config.backends["log"].effective_verbosity(0, 4) == tt.Verbosity.INFO
    assert config.backends["log"].effective_verbosity(2, 4) == tt.Verbosity.ERROR
    assert config.flush_interval <= 1.0


def test_precedence_file_then_arguments_then_environment(tmp_path: Path) -> None:
    """defaults < file < keyword arguments < TRAINTRACE_* variables."""
    file = tmp_path / "tt.toml"
    file.write_text('job_id = "from-file"\nlog_interval = 7\nqueue_size = 100\n[backends.log]\nenabled = false\n')
    config = build_config(config_file=file, env={}, log_interval=9)
    assert (config.job_id, config.log_interval, config.queue_size) == ("from-file", 9, 100)
    assert config.backends["log"].enabled is False
    env = {"TRAINTRACE_LOG_INTERVAL": "11", "TRAINTRACE_BACKENDS_LOG_ENABLED": "true"}
    config = build_config(config_file=file, env=env, log_interval=9)
    assert config.log_interval == 11
    assert config.backends["log"].enabled is True


def test_config_file_from_environment(tmp_path: Path) -> None:
    """TRAINTRACE_CONFIG names the file."""
    file = tmp_path / "c.toml"
    file.write_text('[traintrace]\njob_name = "named"\n')
    assert build_config(env={"TRAINTRACE_CONFIG": str(file)}).job_name == "named"


def test_yaml_file(tmp_path: Path) -> None:
    """YAML works when PyYAML is installed."""
    file = tmp_path / "c.yaml"
    file.write_text("job_id: y\nbackends:\n  file:\n    path: '{job}/r{rank}.jsonl'\n    verbosity: tracing\n")
    config = build_config(config_file=file, env={})
    assert config.backends["file"].path == "{job}/r{rank}.jsonl"
    assert config.backends["file"].verbosity == tt.Verbosity.TRACING


def test_environment_backend_fields() -> None:
    """TRAINTRACE_BACKENDS_<TYPE>_<FIELD> reaches the backend's config."""
    overrides = env_overrides({"TRAINTRACE_BACKENDS_FILE_PATH": "x.jsonl", "TRAINTRACE_BACKENDS_LOG_RANKS": "-1"})
    assert overrides == {"backends": {"file": {"path": "x.jsonl"}, "log": {"ranks": "-1"}}}
    config = build_config(env={"TRAINTRACE_BACKENDS_LOG_RANKS": "-1", "TRAINTRACE_BACKENDS_FILE_FILE_MODE": "0o600"})
    assert config.backends["log"].effective_verbosity(3, 4) == tt.Verbosity.INFO
    assert config.backends["file"].file_mode == 0o600


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"queue_size": 0}, "queue_size"),
        ({"flush_interval": -1}, "flush_interval"),
        ({"writer_nice": -1}, "writer_nice"),
        ({"writer_nice": 20}, "writer_nice"),
        ({"writer_nice": True}, "writer_nice"),
        ({"fork": "sometimes"}, "fork"),
        ({"rank": 4, "world_size": 2}, "rank"),
        ({"backends": {"file": {"verbosity": "loud"}}}, "backends.file.verbosity"),
        ({"backends": {"log": {"ranks": "a-b"}}}, "backends.log.ranks"),
        ({"backends": {"nope": {}}}, "backends.nope"),
        ({"colour": "red"}, "colour"),
        ({"backends": {"log": {"format": "xml"}}}, "backends.log.format"),
    ],
)
def test_bad_settings_name_the_field(settings: dict, field: str) -> None:
    """A bad setting raises ConfigError whose message starts with the field."""
    with pytest.raises(tt.ConfigError) as info:
        tt.configure(**settings)
    assert str(info.value).startswith(field), str(info.value)


def test_bad_environment_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad TRAINTRACE_ value names what is wrong."""
    monkeypatch.setenv("TRAINTRACE_QUEUE_SIZE", "many")
    with pytest.raises(tt.ConfigError, match="queue_size"):
        tt.configure()
    monkeypatch.delenv("TRAINTRACE_QUEUE_SIZE")
    monkeypatch.setenv("TRAINTRACE_SHINY", "1")
    with pytest.warns(tt.TraintraceWarning, match=r"TRAINTRACE_SHINY is not a setting"):
        tt.configure()
    tt.close()


def test_the_variables_that_are_not_settings_are_never_warned_about(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every variable docs/configuration.md lists as not a setting (the command's, the build's) is read by
    configure() without a warning: a user who exports TRAINTRACE_READER or TRAINTRACE_CACHE_DIR for the
    command must not be warned by every training job."""
    table = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    start = table.index("Variables that are not settings")
    rows = [line for line in table[start:].splitlines()[4:] if line.startswith("| `TRAINTRACE_")]
    names = [name for row in rows for name in re.findall(r"`(TRAINTRACE_[A-Z_]+)`", row.split("|")[1])]
    assert {"TRAINTRACE_READER", "TRAINTRACE_CACHE_DIR", "TRAINTRACE_SPARK_MASTER"} <= set(names), names
    for name in names:
        if name not in ("TRAINTRACE_CONFIG", "TRAINTRACE_DISABLED", "TRAINTRACE_PURE"):  # these change the run
            monkeypatch.setenv(name, "x")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tt.configure(backends=[])
    tt.close()
    assert not [str(w.message) for w in caught if issubclass(w.category, tt.TraintraceWarning)]


def test_missing_and_broken_config_files(tmp_path: Path) -> None:
    """An unreadable or malformed file is a ConfigError naming the file."""
    with pytest.raises(tt.ConfigError, match=r"config file"):
        build_config(config_file=tmp_path / "absent.toml", env={})
    broken = tmp_path / "broken.toml"
    broken.write_text("job_id = \n")
    with pytest.raises(tt.ConfigError, match=r"broken\.toml"):
        build_config(config_file=broken, env={})


@pytest.mark.parametrize(
    ("spec", "world", "expected"),
    [
        ("all", 3, {0, 1, 2}),
        ("none", 3, set()),
        (0, 3, {0}),
        (-1, 4, {3}),
        ("last", 4, {3}),
        ("0,2", 4, {0, 2}),
        ("1-3", 8, {1, 2, 3}),
        ([0, 5], 8, {0, 5}),
    ],
)
def test_rank_selectors(spec: object, world: int, expected: set[int]) -> None:
    """Rank selectors name the expected ranks."""
    assert parse_ranks(spec, world) == expected


def test_log_from_rank_zero_errors_from_all(tmp_path: Path) -> None:
    """On rank 1 of 2, the default log backend only takes errors."""
    rec = tt.configure(job_id="j", rank=1, world_size=2, log_dir=str(tmp_path))
    levels = {route.name: route.level for route in rec.routes()}
    assert levels == {"file": tt.Verbosity.PROFILING, "log": tt.Verbosity.ERROR}


def test_backend_disabled_on_other_ranks(tmp_path: Path) -> None:
    """A backend with ranks=0 and no verbosity_elsewhere is absent on rank 1."""
    rec = tt.configure(job_id="j", rank=1, world_size=2, log_dir=str(tmp_path), backends={"file": {"ranks": 0}})
    assert [route.name for route in rec.routes()] == ["log"]


def test_path_placeholders(tmp_path: Path) -> None:
    """Placeholders are filled in, values made safe as path parts."""
    rec = tt.configure(
        job_id="a/b c",
        rank=1,
        world_size=2,
        host="node 7",
        log_dir=str(tmp_path),
        backends={"log": False, "file": {"path": "{job}/{host}-{rank}-of-{world_size}.jsonl"}},
    )
    path = rec.routes()[0].backend.path
    # Values that had to change carry a short hash of the original (issue 17: no collisions).
    job, host = safe_component("a/b c"), safe_component("node 7")
    assert job.startswith("a_b_c-") and host.startswith("node_7-")
    assert path == (tmp_path / job / f"{host}-1-of-2.jsonl").resolve()


@pytest.mark.parametrize("job", ["../../etc", "..", "../x"])
def test_job_id_cannot_escape_the_log_folder(tmp_path: Path, job: str) -> None:
    """A hostile job id stays inside log_dir."""
    rec = tt.configure(job_id=job, log_dir=str(tmp_path / "logs"), backends={"log": False})
    path = rec.routes()[0].backend.path
    assert path.is_relative_to((tmp_path / "logs").resolve())


def test_path_template_cannot_escape_the_log_folder(tmp_path: Path) -> None:
    """A relative template with .. that leaves log_dir is a ConfigError."""
    with pytest.raises(tt.ConfigError, match="leaves the log folder"):
        tt.configure(log_dir=str(tmp_path / "logs"), backends={"file": {"path": "../{rank}.jsonl"}})


def test_unknown_placeholder(tmp_path: Path) -> None:
    """An unknown placeholder is named, with the known ones listed."""
    with pytest.raises(tt.ConfigError, match=r"\{user\}"):
        tt.configure(log_dir=str(tmp_path), backends={"file": {"path": "{user}.jsonl"}})


def test_unwritable_log_dir_is_a_config_error(tmp_path: Path) -> None:
    """A file backend that cannot open its file fails at configure time."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(tt.ConfigError, match=r"backends\.file: cannot start"):
        tt.configure(log_dir=str(blocker))


def test_configure_twice_replaces_and_flushes(tmp_path: Path) -> None:
    """A second configure() closes the first recorder after writing its records."""
    first = tt.MemoryBackend()
    tt.configure(job_id="one", log_dir=str(tmp_path), extra_backends=[first], backends={"log": False})
    tt.event("before")
    second = tt.MemoryBackend()
    tt.configure(job_id="two", log_dir=str(tmp_path), extra_backends=[second], backends={"log": False})
    tt.event("after")
    tt.flush()
    assert [r["name"] for r in first.events()] == ["before"]
    assert first.closed
    assert [r["name"] for r in second.events()] == ["after"]
    assert second.header is not None and second.header["job"] == "two"


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """TRAINTRACE_DISABLED=1 turns every backend off."""
    monkeypatch.setenv("TRAINTRACE_DISABLED", "1")
    rec = tt.configure(log_dir=str(tmp_path))
    assert rec.max_level < 0
    with tt.training_loop():
        pass
    assert not any(tmp_path.iterdir())


def test_identity_explicit_wins_over_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """rank given to configure() beats RANK from the launcher."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    memory = tt.MemoryBackend()
    tt.configure(rank=1, log_dir=str(tmp_path), extra_backends=[memory], backends={"log": False})
    assert memory.header is not None
    assert memory.header["rank"] == 1 and memory.header["world_size"] == 4


def test_identity_from_torchrun_and_slurm() -> None:
    """torchrun and SLURM variables are read without importing torch."""
    torchrun = detect(
        {
            "TORCHELASTIC_RUN_ID": "abc",
            "RANK": "5",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "8",
            "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1",
            "TORCHELASTIC_RESTART_COUNT": "2",
        }
    )
    assert (torchrun.rank, torchrun.local_rank, torchrun.world_size, torchrun.node_rank) == (5, 1, 8, 1)
    assert (torchrun.restart_count, torchrun.job_id, torchrun.launcher) == (2, "abc", "torchelastic")
    slurm = detect({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "991", "SLURM_LOCALID": "1"})
    assert (slurm.rank, slurm.world_size, slurm.job_id, slurm.local_rank) == (3, 4, "991", 1)


def test_unknown_variable_warns_once_with_the_closest_name() -> None:
    """A TRAINTRACE_* typo warns (naming the setting it resembles) and recording still starts."""
    env = {"TRAINTRACE_LOG_INTERVALL": "7", "TRAINTRACE_BACKENDS_FILE_PAHT": "x.jsonl", "TRAINTRACE_JOB_ID": "j"}
    with pytest.warns(tt.TraintraceWarning) as caught:
        config = build_config(env=env)
        build_config(env=env)  # a second configure() does not repeat the warnings
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2, messages
    assert "TRAINTRACE_BACKENDS_FILE_PAHT" in messages[0] and "TRAINTRACE_BACKENDS_FILE_PATH?" in messages[0]
    assert "TRAINTRACE_LOG_INTERVALL" in messages[1] and "TRAINTRACE_LOG_INTERVAL?" in messages[1]
    assert config.job_id == "j" and config.log_interval == 100


def test_the_commands_own_variables_are_not_settings_and_not_warned(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRAINTRACE_MEMORY_LIMIT (read by the command) leaves configure() working and silent."""
    import warnings

    monkeypatch.setenv("TRAINTRACE_MEMORY_LIMIT", "4GB")
    monkeypatch.setenv("TRAINTRACE_VENV", "/tmp/venv")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tt.configure()
        assert tt.is_configured()
        tt.close()
    texts = [str(w.message) for w in caught]
    assert not any("MEMORY_LIMIT" in t for t in texts), texts
    assert any("TRAINTRACE_VENV" in t for t in texts), texts


def test_toml_on_python_310_uses_tomli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without tomllib (Python 3.10) the TOML file is read with tomli."""
    import sys

    pytest.importorskip("tomli")
    monkeypatch.setitem(sys.modules, "tomllib", None)  # what `import tomllib` finds on 3.10
    file = tmp_path / "tt.toml"
    file.write_text('job_name = "floor"\n[backends.log]\nenabled = false\n')
    config = build_config(config_file=file, env={})
    assert config.job_name == "floor" and config.backends["log"].enabled is False
    broken = tmp_path / "broken.toml"
    broken.write_text("job_name = \n")
    with pytest.raises(tt.ConfigError, match=r"broken\.toml"):
        build_config(config_file=broken, env={})


def test_toml_without_a_reader_names_tomli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.10 without tomli: configure() raises a ConfigError that says to install tomli."""
    import sys

    monkeypatch.setitem(sys.modules, "tomllib", None)
    monkeypatch.setitem(sys.modules, "tomli", None)
    file = tmp_path / "tt.toml"
    file.write_text('job_name = "floor"\n')
    with pytest.raises(tt.ConfigError, match=r"tomli"):
        tt.configure(config_file=file)
