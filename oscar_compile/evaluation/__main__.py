"""``python -m oscar_compile.evaluation --model DIR --specs ...``: the ``oscar-compile eval`` command."""
import sys

from ..cli import main

sys.exit(main(["eval", *sys.argv[1:]]))
