"""``python -m archive_tools`` is ``torchrec-serve`` (for a checkout without the console script)."""

import sys

from archive_tools.cli import main

sys.exit(main())
