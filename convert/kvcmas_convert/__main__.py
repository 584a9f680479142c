"""``python -m kvcmas_convert HF_DIR -o OUT.gguf`` (see ``kvcmas_convert.cli``)."""

import sys

from .cli import main

sys.exit(main())
