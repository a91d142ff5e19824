"""Print where a job's time went, from its traintrace files (a minimal reader example)."""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path

from traintrace.reader import read_file


def main(folder: str) -> None:
    files = sorted(Path(folder).glob("*.jsonl"))
    if not files:
        sys.exit(f"no .jsonl files in {folder}")
    for path in files:
        result = read_file(path)
        by_name: dict[str, list[int]] = defaultdict(list)
        for span in result.spans():
            if span.get("dur") is not None:
                by_name[span["name"]].append(span["dur"])
        print(f"{path}: {sum(len(s.records) for s in result.streams)} records, {len(result.bad_lines)} bad lines")
        print(f"  {'span':32} {'count':>7} {'total s':>9} {'median ms':>10}")
        for name, durs in sorted(by_name.items(), key=lambda item: -sum(item[1])):
            print(f"  {name:32} {len(durs):>7} {sum(durs) / 1e9:>9.3f} {statistics.median(durs) / 1e6:>10.3f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "traintrace_logs/demo")
