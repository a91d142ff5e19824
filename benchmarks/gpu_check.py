"""The GPU checks of device timing (issue 18), in one short run (about 2 minutes on one H200).

    python benchmarks/gpu_check.py                 # all checks, one table
    python benchmarks/gpu_check.py --steps 40      # fewer steps
    python benchmarks/gpu_check.py --json out.json # the table as JSON too

1. Phase times: a small MLP trains on CUDA with traintrace's device timing (``gpu_dur`` from CUDA
   events); a separate run of the same model times each phase between two ``torch.cuda.synchronize()``
   calls (the reference). Mean device time per phase must agree within 5% (phases of 1 ms or more).
2. Cost on the training thread per timed span: an empty phase span with device timing on vs off,
   in alternating rounds (median), every span timed (the pool never empty).
3. No added synchronisation: torch's sync debug mode counts synchronising calls while timed steps are
   queued (no more than with timing off), and the CPU time to queue steps with timing on stays far below the device's
   time to run them (a synchronize per span would make them equal).
4. NVML: traintrace's sampler (``_monitor``) against ``nvidia-smi`` read at the same moment.
5. NVTX: with ``nsys`` on the PATH, a short run under ``nsys profile`` must show traintrace's ranges.

On a machine without CUDA it says so and exits 0 without checking anything. Exit status 1 when a
check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

PHASES = ("zero_grad", "model_forward", "model_backward", "optimizer_update")
TOLERANCE = 0.05
MIN_COMPARED_S = 0.001
SPAN_COST_LIMIT_US = 3.0


def no_gpu_reason() -> str | None:
    """Why the checks cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'})"
    return None


# ---------------------------------------------------------------- the model


#: model, optimizer, input, target
Setup = tuple[Any, Any, Any, Any]


def make_model(width: int, layers: int, batch: int) -> Setup:
    import torch
    from torch import nn

    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*blocks, nn.Linear(width, 1)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device="cuda")
    y = torch.randn(batch, 1, device="cuda")
    return model, optimizer, x, y


def step_phases(model: Any, optimizer: Any, x: Any, y: Any) -> Iterator[tuple[str, Any]]:
    """The four phases of a step as (name, thunk), in order."""
    import torch

    state: dict[str, Any] = {}

    def zero_grad() -> None:
        optimizer.zero_grad(set_to_none=True)

    def forward() -> None:
        state["loss"] = torch.nn.functional.mse_loss(model(x), y)

    def backward() -> None:
        state["loss"].backward()

    def update() -> None:
        optimizer.step()

    yield "zero_grad", zero_grad
    yield "model_forward", forward
    yield "model_backward", backward
    yield "optimizer_update", update


def reference_run(setup: Setup, steps: int, warmup: int) -> dict[str, float]:
    """Mean seconds per phase between two torch.cuda.synchronize() calls (the reference)."""
    import torch

    times: dict[str, list[float]] = {p: [] for p in PHASES}
    for step in range(warmup + steps):
        for name, run in step_phases(*setup):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            if step >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {p: statistics.fmean(v) for p, v in times.items()}


def traintrace_run(
    setup: Setup, steps: int, warmup: int, folder: str
) -> tuple[dict[str, float], dict[str, float], dict[str, Any]]:
    """Mean device and CPU seconds per phase as traintrace wrote them, and the device_timing note."""
    import torch

    import traintrace as tt

    tt.configure(
        job_id="gpu-check",
        log_dir=folder,
        backends={"log": False, "console": False, "file": {"path": "rank0.jsonl"}},
        device_sample_interval=0,
        hang_timeout=0,
    )  # device_timing "auto": CUDA is initialised already
    rec = tt.get_recorder()
    assert rec is not None
    if rec.device_timer is None:
        raise SystemExit("gpu_check: device timing did not switch on with CUDA initialised ('auto')")
    with tt.training_loop():
        for step in range(warmup + steps):
            with tt.training_iteration(step):
                for name, run in step_phases(*setup):
                    with tt.span(name):
                        run()
            torch.cuda.synchronize()  # as a loss.item() would, outside the phases
    tt.close()
    records = [json.loads(line) for line in (Path(folder) / "rank0.jsonl").read_text().splitlines()]
    starts = {r["id"]: r for r in records if r["kind"] == "start"}
    device: dict[str, list[int]] = {p: [] for p in PHASES}
    cpu: dict[str, list[int]] = {p: [] for p in PHASES}
    seen: dict[str, int] = {}
    for r in records:
        if r["kind"] not in ("span", "end"):
            continue
        name = r.get("name") or starts.get(r["id"], {}).get("name")
        if name not in device:
            continue
        seen[name] = seen.get(name, 0) + 1
        if seen[name] <= warmup:
            continue
        cpu[name].append(r["dur"])
        if "gpu_dur" in r:
            device[name].append(r["gpu_dur"])
    note: dict[str, Any] = next(
        (r["attrs"] for r in records if r["kind"] == "event" and r["name"] == "device_timing"), {}
    )
    # A span can miss its device time (counted in the note); nearly all must have it.
    missing = [p for p in PHASES if len(device[p]) < 0.9 * steps]
    if missing:
        raise SystemExit(f"gpu_check: phases without gpu_dur on some steps: {missing} (note: {note})")
    return (
        {p: statistics.fmean(v) / 1e9 for p, v in device.items()},
        {p: statistics.fmean(v) / 1e9 for p, v in cpu.items()},
        note,
    )


# ---------------------------------------------------------------- cost and synchronisation


def span_cost(folder: str, rounds: int = 7, batch: int = 400, batches: int = 10) -> dict[str, Any]:
    """Training-thread cost of an empty timed phase span, device timing on minus off (median of rounds)."""
    import traintrace as tt

    per_span: dict[bool, list[float]] = {True: [], False: []}
    pool_empty = 0
    for _ in range(rounds):
        for on in (True, False):
            tt.configure(
                job_id=f"cost-{on}",
                log_dir=folder,
                backends={"log": False, "console": False},
                device_sample_interval=0,
                hang_timeout=0,
                device_timing=on,
            )
            rec = tt.get_recorder()
            assert rec is not None
            spent = 0
            for _ in range(batches):
                t0 = time.perf_counter_ns()
                for _ in range(batch):
                    with tt.forward():
                        pass
                spent += time.perf_counter_ns() - t0
                tt.flush()  # the writer resolves the events: the pool is full again for the next batch
            if on and rec.device_timer is not None:
                pool_empty += rec.device_timer.pool_empty
            tt.close()
            per_span[on].append(spent / (batch * batches) / 1e3)
    on_us = statistics.median(per_span[True])
    off_us = statistics.median(per_span[False])
    return {"on_us": on_us, "off_us": off_us, "cost_us": on_us - off_us, "pool_empty": pool_empty}


def sync_check(setup: Setup, folder: str, steps: int = 6) -> dict[str, Any]:
    """Synchronising calls while timed steps are queued, and CPU queueing time vs the device's time."""
    import torch

    import traintrace as tt

    result: dict[str, Any] = {}
    for on in (False, True):
        tt.configure(
            job_id=f"sync-{on}",
            log_dir=folder,
            backends={"log": False, "console": False},
            device_sample_interval=0,
            hang_timeout=0,
            device_timing=on,
        )
        # Warm the pool and the allocator outside the measurement.
        for _ in range(2):
            with tt.training_iteration(0):
                for name, run in step_phases(*setup):
                    with tt.span(name):
                        run()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                t0 = time.perf_counter()
                for step in range(steps):
                    with tt.training_iteration(step):
                        for name, run in step_phases(*setup):
                            with tt.span(name):
                                run()
                queued = time.perf_counter() - t0
            finally:
                torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
        syncs = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
        tt.close()
        key = "on" if on else "off"
        result[f"queue_s_{key}"] = queued
        result[f"device_s_{key}"] = total
        result[f"syncs_{key}"] = syncs
    return result


# ---------------------------------------------------------------- NVML and NVTX


def nvml_vs_smi() -> dict[str, Any]:
    """traintrace's NVML sample of GPU 0 next to nvidia-smi's reading of the same moment."""
    from traintrace._monitor import _Gpu

    gpu = _Gpu(0)
    if not gpu.present:
        return {"error": "NVML not available to traintrace (pip install 'traintrace[gpu]')"}
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"error": "nvidia-smi not on the PATH"}
    ours = gpu.sample()
    done = subprocess.run(
        [smi, "-i", str(gpu.index), "--query-gpu=memory.used,memory.total,temperature.gpu,power.draw",
         "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    ours_after = gpu.sample()
    if done.returncode != 0:
        return {"error": f"nvidia-smi failed: {done.stderr.strip()[:200]}"}
    used, total, temp, power = (part.strip() for part in done.stdout.strip().splitlines()[0].split(","))
    mib = 1024 * 1024
    return {
        "memory_used_mib": (ours["memory_usage"] / mib, float(used), ours_after["memory_usage"] / mib),
        "memory_total_mib": (ours["memory_total"] / mib, float(total), ours_after["memory_total"] / mib),
        "temperature_c": (ours.get("temperature"), float(temp), ours_after.get("temperature")),
        "power_w": (ours.get("power_draw"), _number(power), ours_after.get("power_draw")),
    }


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


_NVTX_CHILD = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, sys.argv[2])
    import traintrace as tt
    torch.ones(1, device="cuda")
    tt.configure(job_id="nvtx", log_dir=sys.argv[1], backends={"log": False, "console": False, "nvtx": True},
                 device_sample_interval=0, hang_timeout=0)
    x = torch.randn(1024, 1024, device="cuda")
    for step in range(5):
        with tt.training_iteration(step):
            with tt.forward():
                y = x @ x
            with tt.backward():
                y = y @ x
    torch.cuda.synchronize()
    tt.close()
    """
)


def nvtx_under_nsys(folder: str, timeout: float) -> dict[str, Any]:
    nsys = shutil.which("nsys")
    if nsys is None:
        return {"skipped": "nsys not on the PATH"}
    if timeout < 30:
        return {"skipped": "not enough time left"}
    try:
        import nvtx  # noqa: F401
    except ImportError:
        return {"skipped": "the nvtx package is not installed (pip install 'traintrace[nvtx]')"}
    script = Path(folder) / "nvtx_child.py"
    script.write_text(_NVTX_CHILD)
    report = Path(folder) / "nvtx"
    try:
        subprocess.run(
            [nsys, "profile", "-t", "nvtx,cuda", "-o", str(report), "--force-overwrite", "true",
             sys.executable, str(script), folder, str(ROOT / "src")],
            capture_output=True, text=True, timeout=timeout * 0.7, check=True,
        )  # fmt: skip
        stats = subprocess.run(
            [nsys, "stats", "-r", "nvtx_sum", "-f", "csv", f"{report}.nsys-rep"],
            capture_output=True, text=True, timeout=timeout * 0.3, check=True,
        )  # fmt: skip
    except (subprocess.SubprocessError, OSError) as exc:
        return {"error": f"nsys failed: {type(exc).__name__}: {str(exc)[:200]}"}
    names = {"iteration", "model_forward", "model_backward"}
    found = {n for n in names if n in stats.stdout}
    return {"ranges_found": sorted(found), "ranges_expected": sorted(names)}


# ---------------------------------------------------------------- the table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="measured steps per run (default 60)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--budget", type=float, default=170.0, help="seconds the whole check may take")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    reason = no_gpu_reason()
    if reason is not None:
        print(f"gpu_check: {reason}; nothing checked. Run it on a machine with an NVIDIA GPU and torch built for CUDA.")
        return 0
    import torch

    started = time.monotonic()
    name = torch.cuda.get_device_name(0)
    print(f"gpu_check on {name}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    rows: list[tuple[str, str, str, str, str]] = []
    ok = True
    results: dict[str, Any] = {"device": name}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
        setup = make_model(args.width, args.layers, args.batch)
        # 1. phase times
        ours, ours_cpu, note = traintrace_run(setup, args.steps, args.warmup, folder)
        ref = reference_run(setup, args.steps, args.warmup)
        results["phases"] = {p: {"traintrace_s": ours[p], "cpu_s": ours_cpu[p], "reference_s": ref[p]} for p in PHASES}
        results["device_timing_note"] = note
        for phase in PHASES:
            diff = ours[phase] / ref[phase] - 1 if ref[phase] else float("nan")
            gated = ref[phase] >= MIN_COMPARED_S
            passed = not gated or abs(diff) <= TOLERANCE
            ok &= passed
            rows.append(
                (
                    f"{phase} device time (CPU {ours_cpu[phase] * 1e3:.2f} ms)",
                    f"{ours[phase] * 1e3:.3f} ms",
                    f"{ref[phase] * 1e3:.3f} ms (synchronised)",
                    f"{diff * 100:+.1f}%",
                    ("PASS" if passed else "FAIL") if gated else "info (< 1 ms)",
                )
            )
        # 2. cost per span
        cost = span_cost(folder)
        results["span_cost"] = cost
        passed = cost["cost_us"] <= SPAN_COST_LIMIT_US and cost["pool_empty"] == 0
        ok &= passed
        rows.append(
            (
                "training-thread cost per timed span",
                f"{cost['cost_us']:.2f} us",
                f"<= {SPAN_COST_LIMIT_US} us (span {cost['off_us']:.2f} us without)",
                f"pool empty {cost['pool_empty']}",
                "PASS" if passed else "FAIL",
            )
        )
        # 3. synchronisation
        sync = sync_check(setup, folder)
        results["sync"] = sync
        # The model's own code may synchronise (then it does with timing off too): traintrace adds none.
        passed = sync["syncs_on"] <= sync["syncs_off"] and sync["queue_s_on"] < 0.5 * sync["device_s_on"]
        ok &= passed
        rows.append(
            (
                "sync calls while queueing timed steps",
                f"{sync['syncs_on']} (queue {sync['queue_s_on'] * 1e3:.1f} ms)",
                f"{sync['syncs_off']} with timing off (queue {sync['queue_s_off'] * 1e3:.1f} ms)",
                f"device ran them in {sync['device_s_on'] * 1e3:.1f} ms",
                "PASS" if passed else "FAIL",
            )
        )
        # 4. NVML
        nvml = nvml_vs_smi()
        results["nvml"] = nvml
        if "error" in nvml:
            rows.append(("NVML vs nvidia-smi", nvml["error"], "", "", "FAIL"))
            ok = False
        else:
            for key, (before, smi, after) in nvml.items():
                if smi is None or before is None:
                    rows.append((f"NVML {key}", str(before), str(smi), "", "info"))
                    continue
                lo, hi = min(before, after), max(before, after)
                slack = {"memory_used_mib": 64.0, "memory_total_mib": 1.0, "temperature_c": 2.0}.get(key)
                passed = slack is None or lo - slack <= smi <= hi + slack
                ok &= passed
                rows.append(
                    (
                        f"NVML {key}",
                        f"{before:.0f}..{after:.0f}",
                        f"{smi:.0f} (nvidia-smi)",
                        "",
                        "PASS" if passed else "FAIL",
                    )
                    if slack is not None
                    else (f"NVML {key}", f"{before:.0f}..{after:.0f}", f"{smi:.0f} (nvidia-smi)", "", "info")
                )
        # 5. NVTX under nsys
        left = args.budget - (time.monotonic() - started)
        nvtx = nvtx_under_nsys(folder, left)
        results["nvtx"] = nvtx
        if "skipped" in nvtx:
            rows.append(("NVTX ranges under nsys", "skipped", nvtx["skipped"], "", "-"))
        elif "error" in nvtx:
            rows.append(("NVTX ranges under nsys", nvtx["error"], "", "", "FAIL"))
            ok = False
        else:
            passed = nvtx["ranges_found"] == nvtx["ranges_expected"]
            ok &= passed
            rows.append(
                (
                    "NVTX ranges under nsys",
                    ", ".join(nvtx["ranges_found"]) or "none",
                    ", ".join(nvtx["ranges_expected"]),
                    "",
                    "PASS" if passed else "FAIL",
                )
            )
    results["seconds"] = time.monotonic() - started
    results["ok"] = ok
    _print_table(("check", "traintrace", "reference", "difference", "result"), rows)
    print(f"\n{'ALL PASS' if ok else 'SOME CHECKS FAILED'} in {results['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0 if ok else 1


def _print_table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for index, row in enumerate([header, *rows]):
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if index == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
