"""`python -m aiocoll`: the same as the `aiocoll` command."""

import sys

from .cli.main import main

sys.exit(main())
