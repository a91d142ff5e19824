"""One rank of a small DDP job (gloo, CPU) with a fault injected, for tests/test_diagnosis.py.

    traintrace-run --standalone --nproc-per-node 3 tests/diag_worker.py TRUTH_DIR \
        --fault backward --fault-rank 1 --fault-step 7

The worker uses traintrace as a user would (the context API, the DDP hook) and
writes its own truth beside it, without traintrace: ``TRUTH_DIR/rank<N>.jsonl``,
one JSON line per step start and end, the start of each step's data loading, the
initialisation's start and end, checkpoint save (and a background save's copy) and
load, validation pass, fault, an exception leaving the worker, SIGTERM and exit, with
``time.time_ns()`` timestamps. The test computes goodput, where the time went and
the culprit from those lines and compares them with what ``traintrace`` says.

Faults (``--fault``): ``data``, ``forward``, ``backward``, ``optimizer``, ``iteration`` (between phases),
``checkpoint`` (an exception there); ``validation`` (an exception in the validation pass after step
``--fault-step`` - 1; needs ``--validate-every``); ``model_init`` (an exception building the model, before
the loop); ``exit`` (``os._exit(3)`` in backward: no exception, no signal), ``sys_exit`` (``sys.exit(3)``
there: the spans end ``terminated``, the stream closes); ``loader_kill`` (every rank reads
its batches from a DataLoader with one worker process; the faulty rank's worker kills itself with SIGKILL
while fetching batch ``--fault-step``); ``sigkill``, ``sigsegv`` (a real null
pointer read), ``sigterm`` (waits in forward for the test to send SIGTERM); ``freeze`` (stops its own process
with SIGSTOP in forward, as a suspended job or a debugger would: every thread stops, traintrace's too);
``after_loop`` (an exception after the training loop, before the final barrier); ``gil_stuck`` (locks a
pthread mutex twice in forward without releasing the GIL: the deadlock of a C extension; no other thread runs,
and the SIGTERM handler never does);
``kill_in_checkpoint``; ``torn_checkpoint`` (writes half of its save straight to the final file, then
SIGKILL: with ``--resume`` a restart loads that file); ``hang_in_checkpoint`` (sleeps in the save);
``hang_compute`` (sleeps in forward); ``hang_data`` (blocks in data loading opening a FIFO nobody writes: a file
system that stopped answering); ``hang_collective``
(an all-reduce its partner never joins); ``slow_compute`` and ``slow_data``
(from ``--fault-step`` on); ``hang_init`` (sleeps in model initialisation, before DDP's first
broadcast); ``finish_early`` (leaves the training loop before that step and exits 0, as a rank whose
data ran out); ``leak_oom`` (from ``LEAK_STEPS`` steps before ``--fault-step``, forward keeps a 64 MiB tensor
each step under an address-space limit that holds ``LEAK_STEPS`` of them: the allocation at ``--fault-step``
fails as PyTorch's CPU allocator fails when memory runs out); ``cgroup_oom`` (the same leak after the rank
moves itself into the memory cgroup ``--cgroup`` names, which the test made with a limit: the kernel's OOM
killer ends it with SIGKILL); ``none``.

``--fault-host NAME`` gives the fault to every rank whose ``TRAINTRACE_HOST`` is NAME (with ``--fault-local-rank
N``, to the one whose ``LOCAL_RANK`` is N) instead of
``--fault-rank`` (a bad node). ``--fault-attempt N`` injects the fault only in attempt N
(``TORCHELASTIC_RESTART_COUNT``) of a job launched with restarts; ``--later-fault KIND`` injects KIND (same rank
and step) in the attempts after it. Every truth line carries its attempt as ``restart``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import datetime
import io
import json
import os
import resource
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import traintrace as tt
from traintrace.integrations.ddp import record_collectives

#: ``leak_oom``: the leaked tensors' size, and how many fit under the limit before the one that fails.
LEAK_BYTES = 64 << 20
LEAK_STEPS = 4


def resident_bytes() -> int:
    """This process's resident set, from /proc (the test's own reading, beside traintrace's)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def address_space_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")


class Truth:
    def __init__(self, folder: Path, rank: int, restart: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.handle = (folder / f"rank{rank}.jsonl").open("a", buffering=1)
        self.restart = restart

    def write(self, **fields: Any) -> None:
        self.handle.write(json.dumps({"ts": time.time_ns(), "restart": self.restart, **fields}) + "\n")


class Batches(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Batch ``i`` of a rank; with ``kill_at``, the DataLoader worker process fetching batch ``kill_at`` kills
    itself with SIGKILL once the training process waits for it (it creates ``go``), after writing the truth."""

    def __init__(self, rank: int, length: int, kill_at: int | None, go: Path, truth: Truth) -> None:
        self.rank, self.length, self.kill_at, self.go, self.truth = rank, length, kill_at, go, truth

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index == self.kill_at:
            deadline = time.monotonic() + 60
            while not self.go.exists() and time.monotonic() < deadline:
                time.sleep(0.005)
            self.truth.write(event="loader_worker_killed", step=index, pid=os.getpid())
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(self.rank * 100_000 + index))
        return x, x.sum(dim=1, keepdim=True)


def checkpoint_state(model: nn.Module, pad_kb: int, *, copy: bool) -> dict[str, torch.Tensor]:
    """What a save writes: the weights (copied, for a save that writes after the loop went on) and padding
    (optimizer state, say: what makes real checkpoints large)."""
    state = {k: v.clone() if copy else v for k, v in model.state_dict().items()}
    if pad_kb:
        state["pad"] = torch.ones(pad_kb * 256)
    return state


def save(state: dict[str, torch.Tensor], final: Path, step: int, truth: Truth, **note: Any) -> None:
    """Write to a temporary file, then rename; a failed write leaves the worker's own note of where and why
    (the space its file system had left) before it is raised."""
    try:
        torch.save(state, final.with_suffix(".tmp"))
    except (OSError, RuntimeError) as exc:
        space = os.statvfs(final.parent)
        free, total = space.f_bavail * space.f_frsize, space.f_blocks * space.f_frsize
        truth.write(event="checkpoint_failed", step=step, error=str(exc), free=free, total=total, **note)
        raise
    os.replace(final.with_suffix(".tmp"), final)


def created_ns() -> int:
    """When the kernel created this process, on the wall clock (its start in clock ticks after boot, /proc, against
    the time since boot now: within 20 ms)."""
    ticks = os.sysconf("SC_CLK_TCK")
    start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time_ns() - int((uptime - start) * 1e9)


def write_checkpoint(  # noqa: PLR0917 - a thread's target, called by position
    state: dict[str, torch.Tensor], final: Path, step: int, blocking: Any, truth: Truth, fail: bool = False
) -> None:
    """The background part of an asynchronous save; an exception ends this thread, not the training. ``fail``:
    the write fails (a storage error), after the worker's own note."""
    with tt.checkpoint_save_finalization(async_save=blocking):
        if fail:
            truth.write(event="fault", kind="async_save", step=step)
            raise OSError(f"injected failure writing the checkpoint of step {step} in the background")
        save(state, final, step, truth, thread="checkpoint")
    truth.write(event="checkpoint_end", step=step)


@contextlib.contextmanager
def raised_noted(truth: Truth, cleanup_raises: bool = False, abort: bool = False) -> Iterator[None]:
    """An exception out of the worker's body noted as it leaves (the spans it went through have just ended).
    ``cleanup_raises``: a rank that did not inject the fault then runs a cleanup of its own that fails (an emergency
    checkpoint, say), whose exception replaces the one that reached it. ``abort``: such a rank is aborted (SIGABRT)
    a few flush intervals later, as NCCL's watchdog aborts a process whose collective timed out."""
    try:
        yield
    except GeneratorExit:  # this generator finalised at the interpreter's shutdown, a second interrupt having left it
        raise
    except BaseException as exc:
        truth.write(event="raised", error=type(exc).__name__)
        if cleanup_raises and "injected" not in str(exc):
            truth.write(event="cleanup_raised", error="OSError")
            raise OSError("emergency checkpoint failed: no space left on the scratch disk") from exc
        if abort and isinstance(exc, Exception) and "injected" not in str(exc):
            time.sleep(0.3)  # the exception's records written (the flush interval is 0.1 s)
            truth.write(event="abort")
            os.abort()
        raise


def start_abort_watchdog(truth: Truth, rank: int, after_s: float) -> None:
    """A thread that aborts the process once its rank's progress file says it has waited ``after_s`` in a
    collective: NCCL's watchdog, which tears a rank down when its collective times out, no exception raised."""
    from traintrace.progress import read_progress

    path = Path(os.environ["TRAINTRACE_LOG_DIR"]) / os.environ["TRAINTRACE_JOB_ID"] / f"rank{rank}.progress"

    def watch() -> None:
        while True:
            time.sleep(0.1)
            found = read_progress(path)
            since = found.collective_started_ns if found is not None and found.in_collective else None
            if since is not None and time.time_ns() - since > after_s * 1e9:
                truth.write(event="abort", step=found.step if found is not None else None)
                os.abort()

    threading.Thread(target=watch, name="abort-watchdog", daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("truth")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--step-ms", type=float, default=30.0)
    parser.add_argument("--fault", default="none")
    parser.add_argument("--fault-rank", type=int, default=1)
    # Every rank of this host (its TRAINTRACE_HOST) takes the fault instead of --fault-rank: a bad node.
    parser.add_argument("--fault-host", default=None)
    # With --fault-host: only the rank of this LOCAL_RANK on that host (one rank of a chosen node).
    parser.add_argument("--fault-local-rank", type=int, default=None)
    parser.add_argument("--fault-step", type=int, default=7)
    parser.add_argument("--fault-attempt", type=int, default=None)
    parser.add_argument("--later-fault", default="none")
    # A validation pass (a forward on one batch, its loss all-reduced) after every N-th step; 0: none.
    parser.add_argument("--validate-every", type=int, default=0)
    # A restart loads the last checkpoint the failed attempt completed and goes on from its step.
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--slow-ms", type=float, default=40.0)
    # slow_*: slow at every N-th step from --fault-step only (a periodic stall: a rank's own logging, a noisy
    # neighbour's cron job), and for this many steps only (a transient straggler); 0: every step, to the end.
    parser.add_argument("--slow-every", type=int, default=1)
    parser.add_argument("--slow-for", type=int, default=0)
    parser.add_argument("--gloo-timeout", type=float, default=6.0)
    # traintrace's hang detection; 0 turns it off (then only the collective's timeout ends a hang).
    parser.add_argument("--hang-timeout", type=float, default=1.5)
    parser.add_argument("--flush-interval", type=float, default=0.1)
    # The ranks that did not fail run a cleanup of their own that raises, after the failure reached them (they
    # ignore SIGTERM, so that the launcher's does not end them first).
    parser.add_argument("--cleanup-raises", action="store_true")
    # The ranks that did not fail are aborted (SIGABRT) once the failure reached them (their collective timed out),
    # as NCCL's watchdog aborts them; they ignore SIGTERM.
    parser.add_argument("--abort-after-failure", action="store_true")
    # Seconds the SIGTERM handler works before the process ends (an emergency checkpoint save).
    parser.add_argument("--sigterm-cleanup", type=float, default=0.0)
    # A watchdog thread aborts the process (SIGABRT) once it has waited this many seconds in a collective, as
    # NCCL's watchdog does (no exception in Python); give a longer --gloo-timeout. 0: none.
    parser.add_argument("--watchdog-abort", type=float, default=0.0)
    # Seconds a rank stays alive after an exception left main (and traintrace recorded it), before
    # exiting: a process slow to tear down on a loaded machine.
    parser.add_argument("--linger", type=float, default=0.0)
    parser.add_argument("--cgroup", default=None, help="cgroup_oom: the memory cgroup folder to move into")
    # Where checkpoints go (a small file system the test mounted, say), and padding that makes each this large.
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-pad-kb", type=int, default=0)
    # Rank 0's saves write on a thread of their own while training goes on (torch.distributed.checkpoint's
    # async_save): the loop waits only for the copy of the state; each save first waits for the one before.
    parser.add_argument("--async-checkpoint", action="store_true")
    # inf_batch: the faulty rank's batch at the fault step is scaled so that its loss overflows float32 (a
    # corrupt sample); the all-reduce of its gradients spreads NaN to every rank's weights. --nan-check: every
    # rank raises when its loss is NaN (a common guard that misses infinity).
    parser.add_argument("--nan-check", action="store_true")
    # A BatchNorm layer: its running statistics are buffers, which DDP broadcasts from rank 0 at every forward, so
    # rank 0 waits in forward (not in backward's all-reduce) for a rank late with its batch.
    parser.add_argument("--batch-norm", action="store_true")
    # Without record_collectives: DDP's all-reduces and broadcasts recorded nowhere, as in most users' loops.
    parser.add_argument("--no-record-collectives", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    truth = Truth(Path(args.truth), rank, restart)
    truth.write(event="process_start", pid=os.getpid(), host=os.environ.get("TRAINTRACE_HOST"), created=created_ns())
    # Registered before traintrace's own: runs after it (exit handlers run last-in first-out).
    atexit.register(truth.write, event="exit")

    def on_sigterm(signum: int, frame: object) -> None:
        # A SIGTERM may come while the process exits after its exception, its stream closed (no record sees it).
        truth.write(event="sigterm", after_close=not tt.is_configured())
        time.sleep(args.sigterm_cleanup)
        truth.write(event="sigterm_done")  # the process ends now: its interrupted step lasted until here
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    # A user's own handler: traintrace records, then calls it. With --cleanup-raises the ranks wait for their own
    # failure to run the cleanup (the launcher's SIGTERM after a peer died would otherwise race it).
    # --abort-after-failure too: the launcher's SIGTERM would end them before their collective fails.
    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.cleanup_raises or args.abort_after_failure else on_sigterm)
    # DIAG_HANG_TIMEOUT (a node's own environment: test_diagnosis.two_nodes' node_env): its ranks' hang detection.
    hang_timeout = float(os.environ.get("DIAG_HANG_TIMEOUT", args.hang_timeout))
    tt.configure(
        hang_timeout=hang_timeout, hang_check_interval=0.25, flush_interval=args.flush_interval, log_interval=5
    )
    truth.write(event="configured")  # its stream began just before: the job's wall time as records can know it
    if args.watchdog_abort:
        start_abort_watchdog(truth, rank, args.watchdog_abort)
    if args.linger:
        recorded = sys.excepthook

        def linger(*exc_info: Any) -> None:
            recorded(*exc_info)
            time.sleep(args.linger)

        sys.excepthook = linger
    chosen = (
        rank == args.fault_rank
        if args.fault_host is None
        else os.environ.get("TRAINTRACE_HOST") == args.fault_host
        and args.fault_local_rank in (None, int(os.environ.get("LOCAL_RANK", "0")))
    )
    mine = chosen and args.fault_attempt in (None, restart)
    later = chosen and args.fault_attempt is not None and restart > args.fault_attempt
    fault = args.fault if mine else args.later_fault if later else "none"
    fault_step = args.fault_step

    def slow_at(step: int) -> bool:
        since = step - fault_step
        return since >= 0 and since % args.slow_every == 0 and (args.slow_for <= 0 or since < args.slow_for)

    # With --resume, in the truth folder (shared by the attempts), else in a folder of this process's own, also in
    # the truth folder (the test's): a killed worker cannot remove it, and thousands piled up in /tmp.
    if args.checkpoint_dir:
        checkpoints = Path(args.checkpoint_dir)
    elif args.resume:
        checkpoints = Path(args.truth) / "checkpoints"
    else:
        checkpoints = Path(tempfile.mkdtemp(prefix=f"checkpoints-rank{rank}-", dir=args.truth))
    checkpoints.mkdir(parents=True, exist_ok=True)

    def injected(where: str, step: int) -> None:
        if fault == where and step == fault_step:
            truth.write(event="fault", kind=where, step=step)
            raise RuntimeError(f"injected failure in {where} on rank {rank} at step {step}")

    with tt.application(), raised_noted(truth, args.cleanup_raises, args.abort_after_failure):
        truth.write(event="init_start")  # the initialisation spans follow one another: one interval
        with tt.distributed_init(backend="gloo"):
            timeout = datetime.timedelta(seconds=args.gloo_timeout)
            if restart == 0:
                dist.init_process_group("gloo", timeout=timeout)
            else:
                # A restart's gloo would read the failed attempt's addresses, left in the agent's store under
                # the same keys (torchrun 2.13, gloo: "connectFullMesh failed ... Connection refused"): its own keys.
                store = dist.TCPStore(
                    os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
                )
                prefixed = dist.PrefixStore(f"attempt{restart}", store)
                dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world, timeout=timeout)
            partner = dist.new_group([args.fault_rank, (args.fault_rank + 1) % world])
        with tt.model_init():
            if fault == "model_init":
                truth.write(event="fault", kind=fault, step=None)
                raise RuntimeError(f"injected failure in model_init on rank {rank}")
            if fault == "hang_init":  # stuck before its model is built (a slow download, a stuck file system)
                truth.write(event="fault", kind=fault, step=None)
                time.sleep(3600)
            torch.manual_seed(0)
            norm = [nn.BatchNorm1d(16)] if args.batch_norm else []
            model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), *norm, nn.ReLU(), nn.Linear(16, 1)))
            if not args.no_record_collectives:
                record_collectives(model)
        with tt.optimizer_init():
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        truth.write(event="init_end")
        generator = torch.Generator().manual_seed(rank)
        go = Path(args.truth) / f"loader_go.{rank}.{restart}"
        batches = None
        if args.fault == "loader_kill":  # every rank reads from a DataLoader; only the faulty one's worker dies
            kill_at = fault_step if fault == "loader_kill" else None
            dataset = Batches(rank, args.steps, kill_at, go, truth)
            batches = iter(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1))
        leaked: list[torch.Tensor] = []
        writing: threading.Thread | None = None
        first = 0
        saved = sorted(int(p.stem[4:]) for p in checkpoints.glob("step*.pt"))
        if args.resume and restart > 0 and saved:
            truth.write(event="checkpoint_load_start", step=saved[-1])
            loaded = checkpoints / f"step{saved[-1]}.pt"
            with tt.checkpoint_load(current_iteration=saved[-1], checkpoint_path=str(loaded)):
                state = torch.load(loaded)
                state.pop("pad", None)  # --checkpoint-pad-kb's filler, no weight
                model.module.load_state_dict(state)
            first = saved[-1]
            truth.write(event="checkpoint_load_end", step=first)
        with tt.training_loop():
            for step in range(first, args.steps):
                if fault == "finish_early" and step == fault_step:
                    truth.write(event="fault", kind=fault, step=step)
                    break  # its data ran out (uneven inputs): it leaves while the others still train
                truth.write(event="data_start", step=step)
                with tt.data_loading():
                    injected("data", step)
                    if fault == "hang_data" and step == fault_step:
                        stuck = Path(args.truth) / f"stuck.{rank}.{restart}.fifo"
                        os.mkfifo(stuck)
                        truth.write(event="fault", kind=fault, step=step)
                        # Opening a FIFO no process writes to blocks in the kernel: a read that never returns.
                        stuck.open("rb").close()
                    if batches is None:
                        x = torch.randn(4, 8, generator=generator)
                        y = x.sum(dim=1, keepdim=True)
                    else:
                        if fault == "loader_kill" and step == fault_step:
                            truth.write(event="fault", kind=fault, step=step)
                            go.touch()
                        x, y = next(batches)
                    if fault == "slow_data" and slow_at(step):
                        truth.write(event="slow", step=step)
                        time.sleep(args.slow_ms / 1e3)
                    if fault == "inf_batch" and step == fault_step:
                        truth.write(event="fault", kind=fault, step=step)
                        x = x * 1e30
                        y = x.sum(dim=1, keepdim=True)
                truth.write(event="step_start", step=step)
                with tt.training_iteration(step, {"batch_size": len(x)}) as it:
                    truth.write(event="step_entered", step=step)  # the iteration's span began between these two
                    with tt.forward():
                        injected("forward", step)
                        time.sleep(args.step_ms / 1e3)
                        if fault == "slow_compute" and slow_at(step):
                            truth.write(event="slow", step=step)
                            time.sleep(args.slow_ms / 1e3)
                        if fault in ("leak_oom", "cgroup_oom") and step >= fault_step - LEAK_STEPS:
                            if step == fault_step - LEAK_STEPS and fault == "leak_oom":
                                # Room for LEAK_STEPS tensors and 40 MiB of everything else: the next one fails.
                                limit = address_space_bytes() + LEAK_STEPS * LEAK_BYTES + (40 << 20)
                                resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
                            elif step == fault_step - LEAK_STEPS:
                                (Path(args.cgroup) / "cgroup.procs").write_text(str(os.getpid()))
                            truth.write(event="memory", step=step, rss=resident_bytes())
                            try:
                                leaked.append(torch.ones(LEAK_BYTES // 4))
                            except (RuntimeError, MemoryError) as exc:
                                truth.write(event="fault", kind=fault, step=step, rss=resident_bytes(), error=str(exc))
                                raise
                        stops = ("sigkill", "sigsegv", "sigterm", "hang_compute", "freeze", "gil_stuck")
                        if step == fault_step and fault in stops:
                            truth.write(event="fault", kind=fault, step=step)
                            if fault == "sigkill":
                                os.kill(os.getpid(), signal.SIGKILL)
                            elif fault == "freeze":
                                os.kill(os.getpid(), signal.SIGSTOP)
                            elif fault == "gil_stuck":
                                # A PyDLL call keeps the GIL; a futex wait, unlike sleep(), is not ended by a signal.
                                libc, mutex = ctypes.PyDLL(None), ctypes.create_string_buffer(64)  # zeros: unlocked
                                libc.pthread_mutex_lock(mutex)
                                libc.pthread_mutex_lock(mutex)
                            elif fault == "sigsegv":
                                ctypes.string_at(0)
                            elif fault == "sigterm":
                                (Path(args.truth) / "sigterm.pid").write_text(str(os.getpid()))
                                time.sleep(120)
                            else:
                                time.sleep(3600)
                        loss = nn.functional.mse_loss(model(x), y)
                        truth.write(event="loss", step=step, value=float(loss.detach()))
                        if args.nan_check and torch.isnan(loss):
                            truth.write(event="nan_check", step=step)
                            raise FloatingPointError(f"loss is nan at step {step}")
                    with tt.backward():
                        injected("backward", step)
                        if fault in ("exit", "sys_exit") and step == fault_step:
                            truth.write(event="fault", kind=fault, step=step, exit_code=3)
                            if fault == "exit":
                                os._exit(3)
                            sys.exit(3)
                        optimizer.zero_grad(set_to_none=True)
                        loss.backward()
                    with tt.optimizer_step():
                        injected("optimizer", step)
                        optimizer.step()
                    injected("iteration", step)  # inside the step, between its phases
                    if fault == "hang_collective" and step == fault_step:
                        truth.write(event="fault", kind=fault, step=step)
                        with tt.collective(op="all_reduce", group="pair"):
                            dist.all_reduce(torch.ones(1), group=partner)
                    it.add_metrics(loss=loss.detach())
                    truth.write(event="step_leaving", step=step)  # the iteration's span ends between these two
                truth.write(event="step_end", step=step)
                if rank == 0 and (step + 1) % args.checkpoint_every == 0 and args.async_checkpoint:
                    if writing is not None:
                        writing.join()
                    truth.write(event="checkpoint_start", step=step + 1, background=True)
                    final = checkpoints / f"step{step + 1}.pt"
                    with tt.checkpoint_save_async(current_iteration=step + 1, checkpoint_path=str(final)) as blocking:
                        state = checkpoint_state(model.module, args.checkpoint_pad_kb, copy=True)
                    truth.write(event="checkpoint_copied", step=step + 1)  # the loop goes on; the write does not
                    fails = fault == "async_save" and step + 1 == fault_step
                    writing = threading.Thread(
                        target=write_checkpoint,
                        args=(state, final, step + 1, blocking, truth, fails),
                        name="checkpoint",
                    )
                    writing.start()
                elif rank == 0 and (step + 1) % args.checkpoint_every == 0:
                    truth.write(event="checkpoint_start", step=step + 1)
                    final = checkpoints / f"step{step + 1}.pt"
                    with tt.checkpoint_save(current_iteration=step + 1, checkpoint_path=str(final)):
                        if fault == "checkpoint" and step + 1 == fault_step:
                            truth.write(event="fault", kind="checkpoint", step=step + 1)
                            raise OSError(f"injected failure in checkpoint on rank {rank} at step {step + 1}")
                        if fault == "hang_in_checkpoint" and step + 1 == fault_step:  # a stalled file system
                            truth.write(event="fault", kind=fault, step=step + 1)
                            time.sleep(3600)
                        if fault == "kill_in_checkpoint" and step + 1 == fault_step:
                            truth.write(event="fault", kind=fault, step=step + 1)
                            time.sleep(0.05)
                            os.kill(os.getpid(), signal.SIGKILL)
                        if fault == "torn_checkpoint" and step + 1 == fault_step:
                            # torch.save straight to the final name (no temporary file), killed half-way: the
                            # file is there, cut short, and the newest.
                            data = io.BytesIO()
                            torch.save(checkpoint_state(model.module, args.checkpoint_pad_kb, copy=False), data)
                            with final.open("wb") as out:
                                out.write(data.getvalue()[: len(data.getvalue()) // 2])
                            truth.write(event="fault", kind=fault, step=step + 1, path=str(final))
                            os.kill(os.getpid(), signal.SIGKILL)
                        save(checkpoint_state(model.module, args.checkpoint_pad_kb, copy=False), final, step + 1, truth)
                    truth.write(event="checkpoint_end", step=step + 1)
                if args.validate_every and (step + 1) % args.validate_every == 0:
                    truth.write(event="validation_start", step=step + 1)
                    with tt.validation(), torch.no_grad():
                        x = torch.randn(4, 8, generator=generator)
                        loss = nn.functional.mse_loss(model.module(x), x.sum(dim=1, keepdim=True))
                        if fault == "validation" and step + 1 == fault_step:
                            truth.write(event="fault", kind=fault, step=step + 1)
                            raise ValueError(f"injected failure in validation on rank {rank} after step {step}")
                        if fault == "hang_validation" and step + 1 == fault_step:  # stuck reading its batch
                            truth.write(event="fault", kind=fault, step=step + 1)
                            time.sleep(3600)
                        with tt.collective(op="all_reduce"):
                            dist.all_reduce(loss)
                    truth.write(event="validation_end", step=step + 1)
        if writing is not None:
            writing.join()
        if fault == "after_loop":  # writing the final model fails once every step has run
            truth.write(event="fault", kind=fault, step=None)
            raise OSError(f"injected failure saving the final model on rank {rank}")
        if fault != "finish_early":
            dist.barrier()
        dist.destroy_process_group()
    tt.close()
    truth.write(event="process_end")


if __name__ == "__main__":
    main()
