"""``python -m oscar_compile.runtime.serve``: kept for the users it was promised to.

The command is ``oscar-compile serve``; its flags and the assembly of model, compression and
runtime live in ``oscar_compile.cli.serve`` (a layer above the runtime), re-exported here.
"""
import sys

from oscar_compile.cli.serve import (build_app, build_parser, compression_for, engine_config,  # noqa: F401
                                     exposure_warning, logger, main, parse_args, run_server, serve,
                                     server_config)

if __name__ == "__main__":
    sys.exit(main())
