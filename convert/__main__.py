"""`python -m pydflash.convert ...` = `pydflash-convert ...`."""

import sys

from .cli import main

sys.exit(main())
