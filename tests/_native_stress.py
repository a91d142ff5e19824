"""Drives the native core hard for a memory checker (scripts/check_native_memory): spans of
every kind, hostile values, threads, asyncio tasks, a forked child, close and reuse."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import tempfile
import threading
import warnings

import traintrace as tt
from traintrace import _recorder

try:
    import torch
except ImportError:  # the tensor metrics need torch
    torch = None


class HashRaises:
    def __hash__(self) -> int:
        raise RuntimeError("no hash")


def hostile(rec: tt.Recorder, rounds: int) -> None:
    names = ["iteration", "model_forward", "collective", 7, None, b"b", ("t",), HashRaises(), "é" * 100]
    for i in range(rounds):
        name = names[i % len(names)]
        span = tt.Span(name, {"step": [i, 2**70, True, -1][i % 4]}, [1, 3, 2**80, 0][i % 4])
        try:
            with span:
                span.add_metrics(x=i)
                if i % 5 == 0:
                    raise ValueError("in span")
        except (ValueError, TypeError):
            pass
        span.__exit__(None, None, None)  # twice
        try:
            with span:  # reused
                pass
        except TypeError:
            pass
        for field, value in (("t0", "x"), ("parent", 3), ("_rec", 1), ("t1", None), ("written", 3)):
            try:
                setattr(span, field, value)
            except (TypeError, OverflowError):
                pass
        handle = rec.start("handle")
        threading.Thread(target=rec.stop, args=(handle,)).start()
        # record_span: the native case (a small queue: some overflow) and the ones it hands on
        t0 = 1_000 + i
        parent = span if i % 2 else None
        rec.record_span("model_forward", t0, t0 + 5, parent=parent, metrics={"k": i} if i % 3 else None, level=4)
        rec.record_span(name if isinstance(name, str) else "x", [t0, -1, 2**63][i % 3], t0, status=[1, "ok"][i % 2])


def main() -> None:
    warnings.simplefilter("ignore")
    logging.getLogger("traintrace.lib").setLevel(logging.CRITICAL)  # hostile names upset the statistics
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    folder = tempfile.mkdtemp(prefix="traintrace-stress-")
    rec = tt.configure(log_dir=folder, job_id="stress", backends={"log": False}, queue_size=256, log_interval=50)
    assert _recorder.CORE == "native", "the native core is not built"
    with tt.application(), tt.training_loop():
        for step in range(rounds):
            with tt.training_iteration(step) as it:
                with tt.data_loading():
                    pass
                with tt.forward({"b": step}), tt.span("inner"):
                    tt.event("e", {"s": step})
                with tt.collective():
                    pass
                it.add_metrics(loss=1.0)
                if torch is not None and step % 3 == 0:
                    it.add_metrics(loss=torch.tensor(0.5), tokens=torch.tensor(step), batch_size=8, flops=1.0e9)
        hostile(rec, rounds // 4)
        chain = [rec.start("deep") for _ in range(50_000)]
        for span in reversed(chain):
            rec.stop(span)
        del chain

        async def task(n: int) -> None:
            for _ in range(20):
                with tt.span(f"task{n}"):
                    await asyncio.sleep(0)

        async def tasks() -> None:
            await asyncio.gather(*(task(n) for n in range(8)))

        asyncio.run(tasks())
        if hasattr(os, "fork"):
            pid = os.fork()
            if pid == 0:
                with tt.training_iteration(1), tt.forward():
                    pass
                os._exit(0)
            os.waitpid(pid, 0)
    late = rec.start("after close")
    tt.close()
    rec.stop(late)
    with tt.training_iteration(1):
        pass
    print("stress done", tt.stats().get("core"))


if __name__ == "__main__":
    main()
