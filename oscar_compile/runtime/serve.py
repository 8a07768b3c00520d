"""``python -m oscar_compile.runtime.serve``: kept for the users it was promised to.

The command is ``oscar-compile serve``. Its flags live in ``oscar_compile.cli.serve`` and the
assembly of model, compression and runtime in ``oscar_compile.assembly`` (both a layer above the
runtime), re-exported here.
"""
import sys

from oscar_compile.assembly import assemble, build_app, default_compression  # noqa: F401
from oscar_compile.cli.serve import (  # noqa: F401
    app_from_args,
    build_parser,
    compression_for,
    engine_config,
    exposure_warning,
    logger,
    main,
    parse_args,
    run_server,
    serve,
    server_config,
)

if __name__ == "__main__":
    sys.exit(main())
