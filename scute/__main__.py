"""`python -m scute ...` runs the `scute` command."""

import sys

from scute.cli import main

sys.exit(main())
