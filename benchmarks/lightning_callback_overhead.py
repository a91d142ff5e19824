"""Added time per Lightning training step: traintrace's callback vs the reference's vs none.

Needs lightning, traintrace and (for the comparison) ``aidot-training-telemetry``
in one environment, e.g. a separate venv:

    python -m venv .bench-venv
    .bench-venv/bin/pip install torch==2.13.0
    .bench-venv/bin/pip install lightning aidot-training-telemetry torch==2.13.0 -e .
    .bench-venv/bin/python benchmarks/lightning_callback_overhead.py

The same tiny model is trained for ``--steps`` steps per run; runs of the
three modes are interleaved for ``--rounds`` rounds and the median time per
step of each mode is compared with the median of the runs without a
callback. Modes: ``none``; ``empty`` (a callback that does nothing: Lightning's
cost of calling one more callback); ``traintrace`` (defaults: phases as
spans, the per-step hooks in C on the native core); ``tt_python`` (the same with the Python
hooks); ``tt_attrs`` (``phase_spans=False``: one record per step, phase
durations as attributes); ``reference``. Both libraries write every span (iteration, forward, backward,
optimizer step) to a JSON-lines file in a temporary folder and get the FLOPs
per step as a number, so neither measures FLOPs. Timing covers steps after
``--warmup`` up to the end of the epoch, read by a clock callback present in
every mode. Runs must last many writer cycles (``flush_interval``, 0.5 s by
default) so that traintrace's writer thread, which shares the GIL with
training, is measured in its steady state rather than deferred past the end.
``--in-hook`` adds the CPU time spent inside each callback's per-step hooks
(a steadier figure on a busy machine, but it leaves out the writer thread).
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import traintrace as tt
from traintrace.integrations.lightning import TraintraceCallback

FLOPS = 1.0e6
#: traintrace's modes: the default callback (its per-step hooks in C on the native core), ``tt_python`` (the same
#: with the Python hooks: the pure core's, or ``_native_hooks = False``) and ``tt_attrs`` (``phase_spans=False``).
TRAINTRACE_MODES = ("traintrace", "tt_python", "tt_attrs")
NO_GC = False
IN_HOOK = False
FREEZE_GC = False


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(32, 32)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


CLOCKS = {
    "wall": time.perf_counter_ns,
    "thread_cpu": time.thread_time_ns,  # the training thread only
    "process_cpu": time.process_time_ns,  # every thread: includes traintrace's writer
}


class StepClock(Callback):
    """Reads the clocks at the warm-up step and at the end of the epoch."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.t0: dict[str, int] = {}
        self.t1: dict[str, int] = {}
        self.steps = 0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.warmup:
            self.t0 = {name: clock() for name, clock in CLOCKS.items()}

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.t1 = {name: clock() for name, clock in CLOCKS.items()}
        self.steps = trainer.global_step - self.warmup


HOOKS = (
    "on_train_batch_start",
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
)


class InHookTimer:
    """Wraps a callback's per-step hooks and adds up the thread CPU time spent inside them."""

    def __init__(self, callback: Callback, clock: StepClock) -> None:
        self.total = 0
        self.clock = clock
        for name in HOOKS:
            setattr(callback, name, self._timed(getattr(callback, name)))

    def _timed(self, hook: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.clock.t0:
                return hook(*args, **kwargs)
            t0 = time.thread_time_ns()
            try:
                return hook(*args, **kwargs)
            finally:
                self.total += time.thread_time_ns() - t0

        return timed


class Empty(Callback):
    """A callback that overrides nothing: the cost of Lightning calling one more callback."""


def reference_callback(folder: Path) -> Callback:
    from training_telemetry.config import ApplicationConfig, FileBackendConfig, TelemetryConfig
    from training_telemetry.torch.lightning.callback import TelemetryCallback
    from training_telemetry.verbosity import Verbosity

    config = TelemetryConfig(
        backends=[FileBackendConfig(output_file_path=str(folder / "reference"), verbosity=Verbosity.PROFILING)],
        application=ApplicationConfig(job_name="bench", job_id="bench", log_interval=100),
        log_level=logging.WARNING,
    )
    return TelemetryCallback(config=config, batch_flops=FLOPS)


def make_trainer(callbacks: list[Callback]) -> L.Trainer:
    """One epoch on the CPU with nothing but the callbacks (no logger, checkpoints or progress bar)."""
    return L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=50,
    )


def run(mode: str, steps: int, warmup: int, folder: Path) -> dict[str, float]:
    """Seconds per step of one fit, by clock."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(steps * 8, 32), torch.randn(steps * 8, 32))
    clock = StepClock(warmup)
    callbacks: list[Callback] = [clock]
    timer = None
    if mode in TRAINTRACE_MODES:
        tt.close()
        ours = TraintraceCallback(
            log_dir=str(folder / mode),
            job_id="bench",
            backends=[tt.FileBackendConfig()],
            flops_per_step=FLOPS,
            phase_spans=mode != "tt_attrs",
        )
        ours._native_hooks = mode != "tt_python"
        callbacks.append(ours)
    elif mode == "reference":
        callbacks.append(reference_callback(folder))
    elif mode == "empty":
        callbacks.append(Empty())
    if IN_HOOK and len(callbacks) > 1:
        timer = InHookTimer(callbacks[1], clock)
    trainer = make_trainer(callbacks)
    gc.collect()
    if NO_GC:
        gc.disable()
    trainer.fit(Tiny(), DataLoader(data, batch_size=8))
    gc.enable()
    if mode in TRAINTRACE_MODES:
        tt.close()
    if mode == "reference":
        # The reference writes its file on the training thread: let it close before the next run.
        logging.shutdown()
    result = {name: (clock.t1[name] - clock.t0[name]) / 1e9 / clock.steps for name in CLOCKS}
    if IN_HOOK:
        result["in_hook_cpu"] = (timer.total / 1e9 / clock.steps) if timer is not None else 0.0
    return result


class BlockSwitch(Callback):
    """Gives each mode's callback alternate blocks of steps of one fit, and times each block.

    All the callbacks are in the trainer's list for ``setup``, the start of
    training and the end (so each configures and closes itself as in a fit of
    its own); between, the switch, first in the list, keeps only the current
    block's callback after itself. Lightning reads the list at every hook, so a
    block's steps pay exactly that callback's hooks. Measuring blocks of one
    fit, in rotating order, removes what differs between fits (memory layout,
    the machine's state), which on a shared VM is larger than a callback's cost.
    A traintrace block ends with ``traintrace.flush()``, so the block pays its
    writer's work (CPU, and the GIL it takes) instead of handing it on.
    """

    def __init__(self, modes: dict[str, Callback | None], block: int, warmup: int) -> None:
        self.modes = modes
        self.block = block
        self.warmup = warmup
        self.everyone: list[Callback] = []
        self.current: str | None = None
        self.order: list[str] = []
        self.t0: dict[str, int] = {}
        self.blocks: dict[str, list[dict[str, float]]] = {name: [] for name in modes}

    def _block_ended(self) -> None:
        if self.current is None:
            return
        if self.modes[self.current] is not None and self.current in TRAINTRACE_MODES:
            tt.flush()
        now = {name: clock() for name, clock in CLOCKS.items()}
        self.blocks[self.current].append({name: (now[name] - self.t0[name]) / 1e9 / self.block for name in CLOCKS})

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx < self.warmup or (batch_idx - self.warmup) % self.block:
            return
        if not self.everyone:
            self.everyone = list(trainer.callbacks)
            if FREEZE_GC:
                gc.collect()
                gc.freeze()
        self._block_ended()
        if not self.order:  # a new round, in rotated order
            names = list(self.modes)
            turn = sum(len(v) for v in self.blocks.values()) // len(names)
            self.order = names[turn % len(names) :] + names[: turn % len(names)]
        self.current = self.order.pop(0)
        active = self.modes[self.current]
        trainer.callbacks[1:] = [] if active is None else [active]
        self.t0 = {name: clock() for name, clock in CLOCKS.items()}

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        # A partial last block is not counted; everyone sees the end of training.
        self.current = None
        if self.everyone:
            trainer.callbacks[:] = self.everyone


def run_paired(
    modes: list[str], steps: int, block: int, warmup: int, folder: Path
) -> dict[str, list[dict[str, float]]]:
    """Seconds per step of each block of each mode, from one fit."""
    torch.manual_seed(0)
    tt.close()
    callbacks: dict[str, Callback | None] = {"none": None, "empty": Empty()}
    for mode in TRAINTRACE_MODES:
        if mode in modes:
            # One traintrace configuration serves them all: the callbacks differ only in their hooks.
            callbacks[mode] = TraintraceCallback(
                log_dir=str(folder / "paired"),
                job_id="bench",
                backends=[tt.FileBackendConfig()],
                flops_per_step=FLOPS,
                phase_spans=mode != "tt_attrs",
            )
            callbacks[mode]._native_hooks = mode != "tt_python"  # type: ignore[union-attr]
    if "reference" in modes:
        callbacks["reference"] = reference_callback(folder)
    chosen = {mode: callbacks[mode] for mode in modes}
    blocks = len(modes) * ((steps + block - 1) // block)
    switch = BlockSwitch(chosen, block, warmup)
    data = TensorDataset(
        torch.randn((warmup + (blocks + 1) * block) * 8, 32), torch.randn((warmup + (blocks + 1) * block) * 8, 32)
    )
    trainer = make_trainer([switch, *[cb for cb in chosen.values() if cb is not None]])
    gc.collect()
    trainer.fit(Tiny(), DataLoader(data, batch_size=8))
    gc.unfreeze()
    tt.close()
    logging.shutdown()
    return switch.blocks


def report(modes: list[str], times: dict[str, list[dict[str, float]]], clocks: list[str], paired: bool) -> None:
    """Each mode's time per step and what it adds to ``none``'s.

    Paired (blocks of one fit): what a mode adds is the median over rounds of its
    block less the same round's ``none`` block, so a slow stretch of the machine
    cancels out. Per fit: the median of a mode's fits less the median of ``none``'s.
    """
    rounds = min(len(times[mode]) for mode in modes)
    for clock in clocks:
        print(f"\n[{clock}]")
        print(f"{'mode':<12}{'median':>10}{'added':>10}{'q1 added':>10}{'q3 added':>10}   per block or fit (us/step)")
        added: dict[str, float] = {}
        for mode in modes:
            values = [t[clock] for t in times[mode]]
            if paired:
                differences = [times[mode][r][clock] - times["none"][r][clock] for r in range(rounds)]
            else:
                base = statistics.median(t[clock] for t in times["none"])
                differences = [v - base for v in values]
            q1, _, q3 = statistics.quantiles(differences, n=4) if len(differences) > 1 else [differences[0]] * 3
            added[mode] = statistics.median(differences)
            runs = " ".join(f"{v * 1e6:.0f}" for v in values)
            print(
                f"{mode:<12}{statistics.median(values) * 1e6:>10.1f}{added[mode] * 1e6:>10.1f}"
                f"{q1 * 1e6:>10.1f}{q3 * 1e6:>10.1f}   {runs}"
            )
        if "reference" in added:
            for ours_mode in ("empty", *TRAINTRACE_MODES):
                if ours_mode in added:
                    ours = added[ours_mode]
                    ratio = f"{added['reference'] / ours:.1f}x" if ours > 0 else "n/a (none measured)"
                    print(f"reference / {ours_mode} added time: {ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-reference", action="store_true", help="skip the reference library")
    parser.add_argument(
        "--in-hook", action="store_true", help="also add up the CPU time spent inside each callback's hooks"
    )
    parser.add_argument("--no-gc", action="store_true", help="disable the garbage collector during fits")
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() once set up (blocks only): a full collection, which walks the whole heap "
        "(torch, Lightning: 50-200 ms here), then lands in no block at random",
    )
    parser.add_argument(
        "--per-fit",
        action="store_true",
        help="one fit per mode and round (the older method) instead of blocks of one fit",
    )
    parser.add_argument(
        "--modes",
        default="none,empty,traintrace,tt_python,tt_attrs,reference",
        help="comma-separated; none is always run",
    )
    parser.add_argument("--block", type=int, default=500, help="steps per block (the default method)")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch.set_num_threads (0: torch's default, one per core); with 1, torch's worker "
        "does not spin on the core the writer thread would use",
    )
    args = parser.parse_args()
    global NO_GC, IN_HOOK, FREEZE_GC
    NO_GC = args.no_gc
    FREEZE_GC = args.gc_freeze
    IN_HOOK = args.in_hook
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    modes = ["none"] + [
        m for m in args.modes.split(",") if m and m != "none" and not (args.no_reference and m == "reference")
    ]
    with tempfile.TemporaryDirectory(prefix="tt-bench-") as tmp:
        folder = Path(tmp)
        run("none", 300, 50, folder)  # warm the imports and the allocator
        if args.per_fit:
            times: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
            for round_index in range(args.rounds):
                order = modes[round_index % len(modes) :] + modes[: round_index % len(modes)]
                for mode in order:
                    times[mode].append(run(mode, args.steps, args.warmup, folder))
            print(
                f"one fit per mode and round: {args.steps} steps per fit (timed after {args.warmup}), "
                f"{args.rounds} rounds"
            )
        else:
            times = run_paired(modes, args.steps, args.block, args.warmup, folder)
            print(
                f"one fit, blocks of {args.block} steps given to the modes in turn (rotating order), "
                f"{len(times['none'])} blocks per mode after {args.warmup} warm-up steps"
            )
        written = {p.name: p.stat().st_size for p in folder.rglob("*") if p.is_file()}
    clocks = list(CLOCKS) + (["in_hook_cpu"] if IN_HOOK and args.per_fit else [])
    report(modes, times, clocks, paired=not args.per_fit)
    print("files written:", ", ".join(f"{name} {size // 1024} KiB" for name, size in sorted(written.items())))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
