"""The engine's fatal error, here below the worker so that a runner can raise it too.

The tensor-parallel runner's ``TensorParallelError`` (worker/tp_runner.py) is one: the server
answers 503 to every ``EngineDeadError`` (server/app.py), and ``async_engine`` stops its thread on
one marked ``engine_fatal``.
"""


class EngineDeadError(RuntimeError):
    """The engine thread is not running; requests cannot be served."""
