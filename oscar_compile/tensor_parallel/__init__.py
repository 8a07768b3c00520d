"""Tensor parallelism: one process per device, each holding a slice of every layer (shard.py)
and its own KV heads' pages, stepped by rank 0 (launch.py; the step protocol is
``oscar_compile.runtime.worker.tp_runner``). Importing this package imports nothing."""
