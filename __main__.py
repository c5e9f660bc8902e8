"""`python -m memspec` is the `memspec` command."""

import sys

from memspec.launch.cli import main

sys.exit(main())
