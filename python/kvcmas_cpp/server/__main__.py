"""`python -m kvcmas_cpp.server`: the same as the kvcmas-server command."""

import sys

from . import main

sys.exit(main())
