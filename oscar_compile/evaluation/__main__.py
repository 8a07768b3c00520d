"""``python -m oscar_compile.evaluation --model DIR --specs ...``: the ``oscar-compile eval`` command."""
import sys

from .command import main

sys.exit(main(sys.argv[1:]))
