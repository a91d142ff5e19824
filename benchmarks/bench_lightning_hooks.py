"""The Lightning callback's four per-step hooks called back to back: their C twins against the Python hooks.

    .bench-venv/bin/python benchmarks/bench_lightning_hooks.py [--steps 20000] [--rounds 5]

What a step's hooks cost the training thread by themselves (thread CPU), with caches warm: a loop calls
``on_train_batch_start``, ``on_before_backward``, ``on_before_optimizer_step`` and ``on_train_batch_end`` of a
callback set up as ``setup`` leaves it for a profiling fit (the file backend, FLOPs given, metrics read every 50
steps), with a stand-in trainer (``global_step`` and ``current_epoch`` plain attributes: Lightning's are property
chains, 1.5 µs more a read) and a batch of two tensors. The floor is the same four calls to an empty Python
method. Rounds of each alternate; the writer is held back (a flush interval longer than the run, flushed between
rounds) so that its work lands in no round. Lightning's own cost of calling a hook and what a real fit adds are
in lightning_callback_overhead.py.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch

import traintrace as tt
from traintrace import _recorder
from traintrace.integrations.lightning import TraintraceCallback


class Trainer:
    global_step = 0
    current_epoch = 0


class Empty:
    def on_train_batch_start(self, *args: Any) -> None:
        pass

    on_before_backward = on_before_optimizer_step = on_train_batch_end = on_train_batch_start


def callback(native: bool | None) -> Any:
    if native is None:
        return Empty()
    made = TraintraceCallback(flops_per_step=1.0e6)
    made._native_hooks = native
    made._rec = _recorder._active
    made._info = made._trace = made._profile = True
    made._every = 50
    made._flops = 1.0e6
    made._skip_unneeded_hooks(automatic=True)
    return made


def one_round(hooks: Any, steps: int) -> float:
    """Thread CPU per step, in µs."""
    trainer = Trainer()
    batch = (torch.zeros(8, 32), torch.zeros(8, 32))
    outputs = {"loss": torch.tensor(1.0)}
    start, before_backward = hooks.on_train_batch_start, hooks.on_before_backward
    before_step, end = hooks.on_before_optimizer_step, hooks.on_train_batch_end
    t0 = time.thread_time_ns()
    for index in range(steps):
        trainer.global_step = index + 1
        start(trainer, None, batch, index)
        before_backward(trainer, None, None)
        before_step(trainer, None, None)
        end(trainer, None, outputs, batch, index)
    return (time.thread_time_ns() - t0) / steps / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tt-hooks-") as folder:
        tt.configure(
            log_dir=folder, job_id="hooks", backends=[tt.FileBackendConfig()], flush_interval=3600.0, queue_size=1 << 22
        )
        modes: dict[str, Any] = {"empty hooks": None, "Python hooks": False}
        if _recorder.CORE == "native":
            modes["C hooks"] = True
        else:
            print("the native core is not in use: the Python hooks alone")
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.rounds):
            for mode, native in modes.items():
                times[mode].append(one_round(callback(native), args.steps))
                tt.flush()
        tt.close()
    floor = statistics.median(times["empty hooks"])
    print(f"{args.steps} steps a round, {args.rounds} rounds; thread CPU per step (four hooks), µs")
    for mode, values in times.items():
        median = statistics.median(values)
        runs = " ".join(f"{v:.2f}" for v in values)
        print(f"{mode:<14}{median:>8.2f}   above the floor {median - floor:>6.2f}   rounds: {runs}")
    if "C hooks" in times:
        c, python = statistics.median(times["C hooks"]) - floor, statistics.median(times["Python hooks"]) - floor
        print(f"Python / C hooks, above the floor: {python / c:.2f}x")


if __name__ == "__main__":
    main()
