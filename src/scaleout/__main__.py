"""``python -m scaleout`` is the ``scaleout`` command."""

import sys

from scaleout.cli.main import main

sys.exit(main())
