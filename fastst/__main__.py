"""``python -m fastst``: the ``fastst`` command line."""
import sys

from .cli import main

sys.exit(main())
