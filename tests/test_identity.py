"""Identity detection: launchers' variables, precedence, job ids, JAX."""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

import traintrace as tt
from traintrace import MemoryBackend
from traintrace._identity import detect, distributed_view, expand_slurm_counts, scheduler_job_id

_PREFIXES = (
    "RANK",
    "LOCAL_",
    "WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_",
    "TORCHELASTIC_",
    "SLURM_",
    "OMPI_",
    "PMI_",
    "PMIX_",
    "MPI_LOCAL",
    "MASTER_",
    "TRAINTRACE_",
    "PBS_",
    "LSB_",
    "FLUX_",
)


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No launcher variables from the machine running the tests."""
    for key in list(os.environ):
        if key.startswith(_PREFIXES):
            monkeypatch.delenv(key)
    yield monkeypatch
    tt.close()


TORCHRUN = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "TORCHELASTIC_RESTART_COUNT": "2",
    "TORCHELASTIC_RUN_ID": "run-42",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}


def test_torchrun_variables() -> None:
    """torchrun's variables give every field, and its run id is the job id."""
    ident = detect(TORCHRUN)
    assert (ident.rank, ident.local_rank, ident.world_size, ident.local_world_size) == (3, 1, 8, 2)
    assert (ident.node_rank, ident.restart_count) == (1, 2)
    assert ident.job_id == "run-42"
    assert ident.run_id == "run-42"
    assert ident.launcher == "torchelastic"


def test_torchrun_default_run_id_is_not_a_job_id() -> None:
    """torchrun's default run id "none" is ignored; ranks agree on MASTER_ADDR/PORT."""
    ident = detect({**TORCHRUN, "TORCHELASTIC_RUN_ID": "none"})
    assert ident.job_id == "job-10.0.0.1-29500"
    assert ident.run_id is None


def test_torchrun_under_slurm_takes_the_slurm_job_and_torchrun_ranks() -> None:
    """Under SLURM, torchrun's ranks win (SLURM's describe the agent) and SLURM names the job."""
    env = {**TORCHRUN, "TORCHELASTIC_RUN_ID": "none", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "777"}
    ident = detect(env)
    assert ident.rank == 3
    assert ident.world_size == 8
    assert ident.job_id == "777"


def test_slurm_variables() -> None:
    """SLURM gives rank, local rank, node, restart count and the node's task count."""
    env = {
        "SLURM_PROCID": "6",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "7",
        "SLURM_NODEID": "3",
        "SLURM_TASKS_PER_NODE": "2(x3),1",
        "SLURM_RESTART_COUNT": "1",
        "SLURM_JOB_ID": "12345",
    }
    ident = detect(env)
    assert (ident.rank, ident.local_rank, ident.world_size) == (6, 0, 7)
    assert (ident.node_rank, ident.local_world_size, ident.restart_count) == (3, 1, 1)
    assert ident.job_id == "12345"
    assert ident.launcher == "slurm"


def test_slurm_array_job_id() -> None:
    """An array task's job id is <array>_<task>, as SLURM prints it."""
    env = {"SLURM_JOB_ID": "9", "SLURM_ARRAY_JOB_ID": "5", "SLURM_ARRAY_TASK_ID": "2"}
    assert scheduler_job_id(env) == "5_2"


def test_open_mpi_variables() -> None:
    """Open MPI's COMM_WORLD variables and its job id."""
    env = {
        "OMPI_COMM_WORLD_RANK": "5",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "6",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_COMM_WORLD_NODE_RANK": "2",
        "OMPI_MCA_orte_ess_jobid": "4242",
    }
    ident = detect(env)
    assert (ident.rank, ident.local_rank, ident.world_size, ident.local_world_size, ident.node_rank) == (
        5,
        1,
        6,
        2,
        2,
    )
    assert ident.job_id == "4242"
    assert ident.launcher == "openmpi"


def test_pmi_variables() -> None:
    """MPICH / Intel MPI (PMI) variables."""
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    ident = detect(env)
    assert (ident.rank, ident.world_size, ident.local_rank, ident.local_world_size) == (2, 4, 0, 2)
    assert ident.launcher == "pmi"


def test_bare_rank_variables() -> None:
    """RANK/WORLD_SIZE set by hand (mp.spawn scripts, old launchers)."""
    ident = detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "1234"})
    assert (ident.rank, ident.world_size, ident.launcher) == (1, 2, "env")
    assert ident.job_id == "job-localhost-1234"


def test_no_launcher_is_one_process() -> None:
    """Without a launcher: rank 0 of 1 and a generated job id."""
    ident = detect({})
    assert (ident.rank, ident.world_size, ident.launcher) == (0, 1, None)
    assert ident.job_id.startswith("job-")


@given(st.lists(st.tuples(st.integers(0, 64), st.integers(1, 5)), min_size=1, max_size=6))
def test_expand_slurm_counts_round_trip(groups: list[tuple[int, int]]) -> None:
    """SLURM's compressed task counts expand to one count per node."""
    spec = ",".join(f"{count}(x{times})" if times > 1 else str(count) for count, times in groups)
    expected = [count for count, times in groups for _ in range(times)]
    assert expand_slurm_counts(spec) == expected


def test_expand_slurm_counts_rejects_garbage() -> None:
    """An unreadable spec gives no counts (the caller falls back)."""
    assert expand_slurm_counts("two") == []


def test_explicit_configuration_wins_over_the_launcher(env: pytest.MonkeyPatch) -> None:
    """configure(rank=..., world_size=...) beats torchrun's variables."""
    for key, value in TORCHRUN.items():
        env.setenv(key, value)
    memory = MemoryBackend()
    tt.configure(backends=[], extra_backends=[memory], rank=1, world_size=4, job_id="mine")
    assert memory.header is not None
    assert (memory.header["rank"], memory.header["world_size"], memory.header["job"]) == (1, 4, "mine")
    assert memory.header["local_rank"] == 1  # not set explicitly: still detected


def test_traintrace_variables_win_over_the_launcher(env: pytest.MonkeyPatch) -> None:
    """TRAINTRACE_RANK / TRAINTRACE_JOB_ID are explicit configuration too."""
    for key, value in TORCHRUN.items():
        env.setenv(key, value)
    env.setenv("TRAINTRACE_RANK", "0")
    env.setenv("TRAINTRACE_JOB_ID", "from-env")
    memory = MemoryBackend()
    tt.configure(backends=[], extra_backends=[memory])
    assert memory.header is not None
    assert (memory.header["rank"], memory.header["job"], memory.header["restart"]) == (0, "from-env", 2)


def test_jax_process_index_once_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    """JAX is asked for its process index only once jax.distributed says it is initialised."""
    state = {"initialised": False}
    fake = types.SimpleNamespace(
        distributed=types.SimpleNamespace(is_initialized=lambda: state["initialised"]),
        process_index=lambda: 2,
        process_count=lambda: 4,
    )
    monkeypatch.setitem(sys.modules, "jax", fake)
    torch_dist = sys.modules.get("torch.distributed")
    if torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized():
        pytest.skip("a torch process group is active in this process")
    assert distributed_view() is None
    state["initialised"] = True
    assert distributed_view() == (2, 4, "jax.distributed")


def test_old_jax_without_is_initialized_is_not_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A JAX without jax.distributed.is_initialized is never asked (it could break initialize())."""

    def boom() -> int:
        raise AssertionError("must not be called")

    fake = types.SimpleNamespace(distributed=types.SimpleNamespace(), process_index=boom, process_count=boom)
    monkeypatch.setitem(sys.modules, "jax", fake)
    torch_dist = sys.modules.get("torch.distributed")
    if torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized():
        pytest.skip("a torch process group is active in this process")
    assert distributed_view() is None
