"""``traintrace-run``'s own options, read before torchrun sees the command line.

traintrace's options may stand anywhere before the training script, among
torchrun's; everything from the script on belongs to the script. ``--help``
prints traintrace's options first, then torchrun's (when torch is installed).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: torchrun's options that take no value (the rest take one), for finding where the script starts
#: without torch; with torch the parser's own list is used.
_TORCHRUN_FLAGS = frozenset(
    {
        "--standalone",
        "-m",
        "--module",
        "--no-python",
        "--no_python",
        "--run-path",
        "--run_path",
        "--virtual-local-rank",
        "--virtual_local_rank",
    }
)


def flags_of(torchrun_parser: Any | None) -> frozenset[str]:
    """torchrun's options that take no value, from its parser when torch is installed."""
    if torchrun_parser is None:
        return _TORCHRUN_FLAGS
    actions = getattr(torchrun_parser, "_actions", [])
    return _TORCHRUN_FLAGS | {s for a in actions if a.nargs == 0 for s in a.option_strings}


@dataclass
class RunOptions:
    """What ``traintrace-run`` itself was asked to do."""

    metrics_port: int | None = None
    metrics_host: str = ""
    help: bool = False


class OptionError(ValueError):
    """A bad traintrace option; the message is for the user."""


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535, got {port}")
    return port


def own_parser() -> argparse.ArgumentParser:
    """The parser for traintrace's options (also the first part of ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="traintrace-run",
        usage="traintrace-run [traintrace options] [torchrun options] training_script [script args]",
        description=(
            "torchrun, with the launcher's lifecycle recorded beside the workers' streams "
            "(docs/distributed.md). Configuration comes from TRAINTRACE_* variables and TRAINTRACE_CONFIG."
        ),
        add_help=False,
    )
    group = parser.add_argument_group("traintrace options (before the training script)")
    group.add_argument("-h", "--help", action="store_true", help="show this help, then torchrun's, and exit")
    group.add_argument(
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="serve Prometheus metrics for this node's ranks at http://HOST:PORT/metrics "
        "(needs 'traintrace[prometheus]'; docs/integrations/prometheus.md)",
    )
    group.add_argument(
        "--metrics-host", default="", metavar="HOST", help="address to serve metrics on (default: all interfaces)"
    )
    return parser


_OWN_WITH_VALUE = ("--metrics-port", "--metrics-host")


def split(argv: Sequence[str], flags: frozenset[str] = _TORCHRUN_FLAGS) -> tuple[RunOptions, list[str]]:
    """traintrace's options, and the command line left for torchrun.

    Raises :class:`OptionError` for a bad value.
    """
    own: list[str] = []
    rest: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        token = args[i]
        name = token.split("=", 1)[0]
        if token == "--" or not token.startswith("-"):
            break  # the training script (or torchrun's separator): the rest is not ours
        if name in _OWN_WITH_VALUE:
            if "=" in token:
                own.append(token)
                i += 1
            else:
                own.extend(args[i : i + 2])
                i += 2
            continue
        if name in ("-h", "--help"):
            own.append("--help")
            i += 1
            continue
        step = 1 if "=" in token or name in flags else 2
        rest.extend(args[i : i + step])
        i += step
    rest.extend(args[i:])
    parser = own_parser()

    def fail(message: str) -> Any:
        raise OptionError(message)

    parser.error = fail  # type: ignore[method-assign]
    found = parser.parse_args(own)
    return RunOptions(metrics_port=found.metrics_port, metrics_host=found.metrics_host, help=found.help), rest


def print_help(torchrun_parser: Any | None) -> None:
    """traintrace's options, then torchrun's (or how to get them)."""
    out = sys.stdout
    out.write(own_parser().format_help())
    out.write("\ntorchrun options (traintrace-run passes them on unchanged):\n\n")
    if torchrun_parser is None:
        out.write("  (torch is not installed: pip install 'traintrace[torch]' to launch jobs)\n")
    else:
        out.write(torchrun_parser.format_help())
    out.flush()
