#!/usr/bin/env bash
# format_float's cost on 1/(i+1), 100,000 values: ns per call (best of 20) and, with valgrind,
# instructions per call (callgrind, format_float_as inclusive), fast path against the dtoa fallback.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
out=$(mktemp -d)
inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
libdir=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
ver=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("LDVERSION"))')
${CC:-gcc} -O2 -std=c11 -g -I"$inc" -Wall -Wextra -Wno-missing-field-initializers -Wno-unused-function \
    "$ROOT/benchmarks/float_driver.c" -o "$out/driver" -L"$libdir" -Wl,-rpath,"$libdir" -lpython"$ver" -lm
for mode in dtoa fast; do
    for style in 0 1; do "$out/driver" $mode $style 100000 20; done
done
if command -v valgrind >/dev/null; then
    for mode in dtoa fast; do
        valgrind --tool=callgrind --toggle-collect=format_float_as --callgrind-out-file="$out/cg.$mode" \
            "$out/driver" $mode 1 100000 1 >/dev/null 2>&1
        total=$(callgrind_annotate "$out/cg.$mode" | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
        echo "$mode: $((total / 100000)) instructions per format_float call (callgrind, style 1)"
    done
fi
rm -rf "$out"
