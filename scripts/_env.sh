# Sourced by scripts/test and scripts/demo: makes .venv with everything the
# project needs, reinstalling only when the requirements change.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VENV=${TRAINTRACE_VENV:-$ROOT/.venv}
PY=$VENV/bin/python
if [ ! -x "$PY" ]; then
    echo "creating $VENV" >&2
    python3 -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip >&2
fi
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
TORCH_PIN=${TRAINTRACE_TORCH_PIN:-torch==2.13.0}
EXTRAS=${TRAINTRACE_EXTRAS:-dev}
want=$(cat pyproject.toml scripts/_env.sh | sha256sum | cut -c1-16)-$EXTRAS
have=$(cat "$VENV/.traintrace-deps" 2>/dev/null || true)
if [ "$want" != "$have" ]; then
    echo "installing packages into $VENV (first run takes a few minutes)" >&2
    # PySpark (the dev extra's) comes from PyPI as a source distribution of 450 MB whose wheel pip builds: 40 s
    # of the 150 s that the packages took on a 2-core machine. Built while torch installs, then installed from it.
    wheels=$VENV/.built-wheels
    pyspark_build=""
    built=()
    if grep -q '"pyspark' pyproject.toml && [ "$EXTRAS" = dev ]; then
        mkdir -p "$wheels"
        spec=$(grep -o '"pyspark[^"]*"' pyproject.toml | head -1 | tr -d '"')
        "$PY" -m pip wheel -q --no-deps -w "$wheels" "$spec" >/dev/null 2>&1 &
        pyspark_build=$!
        built=(--find-links "$wheels")
    fi
    "$PY" -m pip install -q "$TORCH_PIN" >&2
    if [ -n "$pyspark_build" ]; then
        wait "$pyspark_build" || echo "building pyspark's wheel beforehand failed: pip builds it now" >&2
    fi
    "$PY" -m pip install -q "${built[@]}" -e ".[$EXTRAS]" >&2
    rm -rf "$wheels"
    echo "$want" > "$VENV/.traintrace-deps"
fi
# The native core (src/native/*.c) in place beside the sources: cheap when up to date, and a
# missing compiler only warns (the pure-Python core runs then).
"$PY" setup.py -q build_ext --inplace >&2 || echo "could not build the native core: testing the pure-Python core only" >&2
