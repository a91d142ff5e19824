"""Instructions a Lightning training step executes with each callback, counted by valgrind's callgrind.

    .bench-venv/bin/python benchmarks/lightning_callback_instructions.py [--steps 200] [--modes ...]

Times on a shared VM spread by more than a callback costs (lightning_callback_overhead.md); instructions
executed do not. Each mode is one process under ``valgrind --tool=callgrind`` training the tiny model of
lightning_callback_overhead.py, with counting switched on (``callgrind_control -i on``) at step 50 and off
``--steps`` steps later: what the steps themselves execute, every thread (traintrace's writer included),
imports and set-up excluded. Modes: ``none``, ``empty`` (a callback whose hooks do nothing: Lightning's own
cost of calling a callback's hooks), ``traintrace`` (per-step hooks in C on the native core), ``tt_python``
(its Python hooks), ``reference``. Prints the instructions each adds to a step over ``none`` and the ratios.

Instructions are not time: a cache miss or a system call costs more than an instruction (the reference's
writes to its file, on the training thread, are system calls callgrind does not count), and the writer's run
on the other core in parallel. Needs valgrind (``callgrind_control`` with it).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WARMUP = 50


def child(mode: str, steps: int) -> None:
    """The fit, under callgrind (``--child``)."""
    import logging

    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(HERE))
    import lightning_callback_overhead as fit
    import traintrace as tt
    from traintrace.integrations.lightning import TraintraceCallback

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)

    class Counting(Callback):
        def on_train_batch_start(self, trainer: object, pl_module: object, batch: object, batch_idx: int) -> None:
            if batch_idx in (WARMUP, WARMUP + steps):
                switch = "on" if batch_idx == WARMUP else "off"
                subprocess.run(["callgrind_control", "-i", switch, str(os.getpid())], check=True, capture_output=True)

    folder = Path(tempfile.mkdtemp(prefix="tt-callgrind-"))
    callbacks: list[Callback] = [Counting()]
    if mode in ("traintrace", "tt_python"):
        ours = TraintraceCallback(
            log_dir=str(folder), job_id="callgrind", backends=[tt.FileBackendConfig()], flops_per_step=fit.FLOPS
        )
        ours._native_hooks = mode == "traintrace"
        callbacks.append(ours)
    elif mode == "reference":
        callbacks.append(fit.reference_callback(folder))
    elif mode == "empty":
        callbacks.append(fit.Empty())
    torch.manual_seed(0)
    count = (WARMUP + steps + 10) * 8
    data = TensorDataset(torch.randn(count, 32), torch.randn(count, 32))
    fit.make_trainer(callbacks).fit(fit.Tiny(), DataLoader(data, batch_size=8))
    tt.close()
    logging.shutdown()
    shutil.rmtree(folder, ignore_errors=True)


def count(mode: str, steps: int, folder: Path) -> int:
    """Instructions counted for ``mode``'s steps."""
    out = folder / f"callgrind.{mode}.out"
    run = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={out}",
            sys.executable,
            __file__,
            "--child",
            mode,
            "--steps",
            str(steps),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    found = re.search(r"Collected : (\d+)", run.stderr)
    if run.returncode != 0 or found is None:
        raise SystemExit(f"{mode}: callgrind run failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--modes", default="none,empty,traintrace,tt_python,reference")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps)
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("needs valgrind (and its callgrind_control) on PATH")
    modes = ["none"] + [m for m in args.modes.split(",") if m and m != "none"]
    with tempfile.TemporaryDirectory(prefix="tt-callgrind-") as tmp:
        counted = {mode: count(mode, args.steps, Path(tmp)) for mode in modes}
    base = counted["none"] / args.steps
    print(f"instructions per step, steps {WARMUP} to {WARMUP + args.steps} of one fit each, every thread")
    added = {}
    for mode in modes:
        per_step = counted[mode] / args.steps
        added[mode] = per_step - base
        print(f"{mode:<12}{per_step:>14,.0f}   added {added[mode]:>12,.0f}")
    if "reference" in added:
        for mode in ("empty", "traintrace", "tt_python"):
            if added.get(mode, 0) > 0:
                print(f"reference / {mode} added instructions: {added['reference'] / added[mode]:.2f}x")


if __name__ == "__main__":
    main()
