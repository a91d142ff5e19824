"""Drives the native scanner (traintrace._scan) hard for a memory checker (scripts/check_native_memory):
damaged and random lines, escapes, every chunk size from one byte up, several threads, streams released
before their end, a file that vanishes. Reads the stream in C (``_drain``), so no DuckDB runs under valgrind.

    python tests/_scan_stress.py ROUNDS
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

from traintrace._scan import Scanner
from traintrace.cli._engine import CORE_COLUMNS, RARE_KINDS
from traintrace.cli._reader import scan_fields

LINES = [
    b'{"seq":0,"kind":"header","ts":1,"schema":"traintrace","schema_version":1,"rank":0,"host":"h\\"\\u00e9"}',
    b'{"seq":5,"kind":"span","ts":17,"name":"iteration","id":4,"dur":100,"status":"ok","attrs":{"step":0,"loss":1.5}}',
    b'{"kind":"error","message":"\\ud83d\\ude00 \\n","stack":"x","attrs":{"unhandled":true,"n":[1,{"a":null}]}}',
    b'{"kind":"span","dur":2.5}',
    b'{"kind":"sp\\u0061n","name":"iteration","attrs":{"st\\u0065p":"7"}}',
    b'{"kind":"x\\ud800"}',
    b'{"kind":"event","attrs":' + b"[" * 2000 + b"]" * 2000 + b"}",
    b"\xef\xbb\xbf\x00\xff\xc0\x80",
    b'{"kind":"span","ts":99999999999999999999}',
]


def damaged(line: bytes, rnd: random.Random) -> bytes:
    at = rnd.randrange(len(line) + 1)
    choice = rnd.randrange(4)
    if choice == 0:
        return line[:at]
    if choice == 1:
        return line[:at] + bytes([rnd.randrange(256)]) + line[at:]
    if choice == 2:
        return line[:at] + line[at + 1 :]
    return line


def main(rounds: int) -> None:
    rnd = random.Random(15)
    fields = scan_fields(CORE_COLUMNS)
    with tempfile.TemporaryDirectory() as folder:
        for n in range(rounds):
            paths = []
            for i in range(rnd.randrange(1, 4)):
                lines = [damaged(rnd.choice(LINES), rnd) for _ in range(rnd.randrange(0, 40))]
                lines.append(json.dumps({"kind": "span", "name": "n" * rnd.randrange(50), "dur": n}).encode())
                path = Path(folder) / f"rank{i}.jsonl"
                path.write_bytes(b"\n".join(lines) + rnd.choice([b"\n", b""]))
                paths.append(str(path))
            scanner = Scanner(
                paths,
                fields,
                "span",
                "iteration",
                ("step", "batch_size"),
                RARE_KINDS,
                lean=rnd.random() < 0.5,
                threads=rnd.randrange(1, 4),
                chunk_size=rnd.choice([1, 2, 7, 64, 1000, 1 << 22]),
            )
            if n % 7 == 0:
                capsule = scanner.__arrow_c_stream__()  # taken and released unread: the workers stop
                del capsule
                continue
            if n % 11 == 0:
                Path(paths[0]).unlink()
                try:
                    scanner._drain()
                except OSError:
                    pass
                continue
            scanner._drain()
            scanner.deferred()
    print("scan stress done")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
