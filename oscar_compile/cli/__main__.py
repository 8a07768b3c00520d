"""``python -m oscar_compile.cli``: the ``oscar-compile`` command."""
import sys

from . import main

sys.exit(main())
