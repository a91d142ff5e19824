"""``python -m traintrace.cli``: the same as the ``traintrace`` command."""

from . import entry

entry()
