"""Shared fixtures: every test gets a clean traintrace and a clean environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

import traintrace as tt
from tests._reliability import core_env
from traintrace import _recorder
from traintrace.backends._scalars import framework_logs

ROOT = Path(__file__).resolve().parents[1]

# pytest keeps each test module's assertion-rewritten bytecode beside it, unless bytecode writing is off (CI's machines
# set PYTHONDONTWRITEBYTECODE): then each of the two passes' 8 workers rewrote all 190 test modules again, 4 s of CPU
# each time. This process writes them; the processes the tests start keep the environment's setting.
sys.dont_write_bytecode = False

# The fast inner loop (scripts/test --fast) draws fewer examples in property tests that keep
# hypothesis's default count; tests that set their own count use tests._examples.examples().
settings.register_profile("fast", max_examples=20)
if os.environ.get("TRAINTRACE_FAST_TESTS") == "1":
    settings.load_profile("fast")
SCHEMA_PATH = ROOT / "src" / "traintrace" / "schema" / "record-v1.schema.json"


@cache
def _validator() -> Any:
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


def validate_record(record: dict[str, Any]) -> None:
    """Fail the test if ``record`` does not match record format v1."""
    errors = sorted(_validator().iter_errors(record), key=str)
    assert not errors, f"{record} violates the schema: {errors[0].message}"


#: ``read_jsonl`` validates every record up to this many, then a deterministic sample.
CHECK_ALL_FIRST = 300
#: After the first ``CHECK_ALL_FIRST``: every this-many-th record (a prime, so that it does not
#: beat in step with a loop's period) is validated too.
CHECK_EVERY = 97


def _shape(record: dict[str, Any]) -> tuple[object, ...]:
    """What makes two records different for the schema: kind, name, fields, attribute types."""
    attrs = record.get("attrs")
    attr_types = frozenset((k, type(v).__name__) for k, v in attrs.items()) if isinstance(attrs, dict) else None
    return (record.get("kind"), record.get("name"), frozenset(record), attr_types)


def validate_records(records: list[dict[str, Any]]) -> None:
    """Validate a sample of ``records``: all of the first ``CHECK_ALL_FIRST``, the first record of
    every distinct shape (kind, name, fields, attribute types), the last, and every ``CHECK_EVERY``-th.

    A stream of 20,000 identical iteration spans costs what 500 records do; every kind of record
    in it is still checked. The schema's own tests use ``validate_all_records``.
    """
    seen: set[tuple[object, ...]] = set()
    last = len(records) - 1
    for i, record in enumerate(records):
        shape = _shape(record)
        if i < CHECK_ALL_FIRST or i == last or i % CHECK_EVERY == 0 or shape not in seen:
            seen.add(shape)
            validate_record(record)


def validate_all_records(records: list[dict[str, Any]]) -> None:
    """Validate every one of ``records`` (for the tests whose subject is the schema)."""
    for record in records:
        validate_record(record)


def read_jsonl(path: Path, *, check: str = "sample") -> list[dict[str, Any]]:
    """Every line of a JSONL file, parsed and validated against the schema.

    ``check="sample"`` validates as ``validate_records`` does; ``check="all"`` every record.
    """
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if check == "all":
        validate_all_records(records)
    else:
        assert check == "sample", check
        validate_records(records)
    return records


# Every test that starts a process carries @pytest.mark.subprocess, so that
# ``pytest -m "not subprocess"`` is the fast inner loop. An audit hook notices a process
# started by an unmarked test, and the test fails at teardown saying so.
_SPAWN_EVENTS = frozenset(
    {
        "subprocess.Popen",
        "os.fork",
        "os.forkpty",
        "os.posix_spawn",
        "os.spawn",
        "os.exec",
        "os.system",
        "pty.spawn",
        "_posixsubprocess.fork_exec",
    }
)
_unmarked_test: str | None = None
_spawned_by: dict[str, str] = {}


def _notice_spawn(event: str, args: tuple[Any, ...]) -> None:
    if event in _SPAWN_EVENTS and _unmarked_test is not None and os.getpid() == _pytest_pid:
        _spawned_by.setdefault(_unmarked_test, event)


_pytest_pid = os.getpid()
sys.addaudithook(_notice_spawn)


def _watch_fork_exec() -> None:
    """multiprocessing's spawn and forkserver start a process through ``_posixsubprocess`` with no
    audit event: wrap it so that they are noticed too."""
    try:
        import _posixsubprocess
    except ImportError:  # not POSIX
        return
    fork_exec = _posixsubprocess.fork_exec

    def watched_fork_exec(*args: Any, **kwargs: Any) -> Any:
        _notice_spawn("_posixsubprocess.fork_exec", args)
        return fork_exec(*args, **kwargs)

    _posixsubprocess.fork_exec = watched_fork_exec


_watch_fork_exec()


#: scripts/test sets this for its pure-Python pass when the native pass ran before it.
AFTER_NATIVE_PASS = "TRAINTRACE_TESTS_AFTER_NATIVE_PASS"


def pytest_configure(config: pytest.Config) -> None:
    """pytest 9.2 stores a test's id where pytest-xdist 3.8 does not set it, and ``xdist_group`` then has no effect:
    said before the workers start (they would only stop, below, without a message)."""
    if config.getoption("dist", "no") != "loadgroup":
        return
    import xdist

    if pytest.version_tuple[:2] >= (9, 2) and tuple(int(x) for x in xdist.__version__.split(".")[:2]) <= (3, 8):
        raise pytest.UsageError(
            f"--dist loadgroup: pytest {pytest.__version__} with pytest-xdist {xdist.__version__} ignores "
            "xdist_group; install pytest<9.2 (pip install -e '.[dev]' does)"
        )


@pytest.hookimpl(trylast=True)  # after pytest-xdist's, which adds each test's group to its id
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``once`` do the same in both passes: the second runs them only if the first could not; slow tests
    run first.

    And under ``--dist loadgroup``, a test marked ``xdist_group`` must carry its group in its id: without it the
    group is split over the workers (pytest 9.2 with pytest-xdist 3.8 ran the Spark tests on two JVMs), said here.
    """
    if config.getoption("loadgroup", False):
        split = [item.nodeid for item in items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
        if split:
            raise pytest.UsageError(
                f"xdist_group is not honoured ({split[0]} carries no group): pytest {pytest.__version__} with this "
                "pytest-xdist; install pytest<9.2 (pip install -e '.[dev]' does)"
            )
    # The slow tests (real jobs: torchrun, Lightning, Spark) first, in their order, the quick ones after: pytest-xdist
    # hands out tests in this order, so the pass ends on quick tests instead of one worker finishing a long one
    # while the others wait.
    items.sort(key=lambda item: 0 if item.get_closest_marker("slow") else 1)
    if os.environ.get("TRAINTRACE_PURE") != "1" or os.environ.get(AFTER_NATIVE_PASS) != "1":
        return
    skip = pytest.mark.skip(reason="the same in either core's pass (marked once): ran in the native pass")
    for item in items:
        if item.get_closest_marker("once") and not item.get_closest_marker("each_core"):
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    global _unmarked_test
    _unmarked_test = None if item.get_closest_marker("subprocess") else item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Iterator[None]:
    """A process started while setting up a shared (module or session) fixture, such as a
    certificate made with openssl once per session, is set-up, not the work of the test that
    happened to ask for it first."""
    global _unmarked_test
    if fixturedef.scope == "function":
        yield
        return
    saved, _unmarked_test = _unmarked_test, None
    try:
        yield
    finally:
        _unmarked_test = saved


@pytest.fixture(autouse=True)
def _subprocess_tests_are_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    event = _spawned_by.pop(request.node.nodeid, None)
    if event is not None:
        pytest.fail(f"{request.node.nodeid} starts a process ({event}) but is not marked @pytest.mark.subprocess")


@pytest.fixture(autouse=True)
def _clean_traintrace(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    for key in list(os.environ):
        if key == "TRAINTRACE_PURE":
            continue  # which recording core the whole run tests (scripts/test runs both)
        if key.startswith(("TRAINTRACE_", "OTEL_")) or key in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_RESTART_COUNT",
            "SLURM_PROCID",
            "SLURM_JOB_ID",
            "MASTER_PORT",
        ):
            monkeypatch.delenv(key, raising=False)
    # The command's scanner reads the suite's jobs however small (by default it reads only jobs of 32 MiB or
    # more): here and in the processes that inherit the environment; tests/test_diagnosis.py passes it to the
    # commands it runs on real jobs. DuckDB's reader reads them in the pure pass; tests/test_cli_reader.py tests
    # the default.
    monkeypatch.setenv("TRAINTRACE_READER", "native")
    monkeypatch.chdir(tmp_path)
    _recorder._warned.clear()
    framework_logs.active = False  # set by the Lightning/HF callbacks for the process (trackers' tests)
    yield
    tt.close()
    _recorder._warned.clear()


@pytest.fixture
def memory(tmp_path: Path) -> Iterator[tt.MemoryBackend]:
    """traintrace configured with only an in-memory backend (and a file under tmp_path)."""
    backend = tt.MemoryBackend()
    tt.configure(job_id="test", log_dir=str(tmp_path / "logs"), backends={"log": False}, extra_backends=[backend])
    yield backend
    tt.close()


@pytest.fixture(scope="session")
def cpu_example_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job folder of one run of ``examples/train_cpu.py --epochs 2``, shared by the tests that
    only read it (mark them ``@pytest.mark.xdist_group("cpu_example")`` so they share one worker)."""
    logs = tmp_path_factory.mktemp("cpu_example")
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_cpu.py"), "--log-dir", str(logs), "--epochs", "2"],
        check=True,
        capture_output=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), **core_env()},
    )
    return logs / "demo"
