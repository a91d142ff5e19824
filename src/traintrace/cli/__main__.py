"""``python -m traintrace.cli``: the same as the ``traintrace`` command."""

import sys

from . import main

sys.exit(main())
