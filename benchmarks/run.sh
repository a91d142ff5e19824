#!/usr/bin/env bash
# Makes .bench-venv (the reference library from PyPI, orjson, this checkout) and runs a benchmark.
#   bash benchmarks/run.sh                 # bench_core.py
#   bash benchmarks/run.sh bench_core.py --quick
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=$ROOT/.bench-venv
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
script=${1:-bench_core.py}
shift || true
extra=""
case "$script" in
    # The command's benchmarks need its analysis extra (DuckDB).
    bench_cli.py | bench_insight.py) extra="[analysis]" ;;
esac
"$VENV/bin/python" -m pip install -q aidot-training-telemetry==1.1.2 orjson -e "$ROOT$extra" >&2
if [ "$script" = bench_mlp.py ] || [ "$script" = bench_ddp_buffers.py ]; then
    # A real training step: torch pinned, as everywhere (an unpinned torch pulls a CUDA build).
    "$VENV/bin/python" -m pip install -q "${TRAINTRACE_TORCH_PIN:-torch==2.13.0}" >&2
fi
exec "$VENV/bin/python" "$ROOT/benchmarks/$script" "$@"
