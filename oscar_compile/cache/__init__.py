"""The paged KV cache, below the passes and the runtime that both use it, above the kernels it calls.

- ``contract``: the graph-to-cache protocol the rewritten attention graphs call.
- ``nodes``: the two graph nodes around the ``oscar::`` ops that ask a cache for their inputs.
- ``hf_cache``: the cache behind Hugging Face ``generate()``, one implementation of the contract
  (the runtime's ``StepCache`` is the other).

What the cache looks like (windows, pages, the per-layer ``LayerFormat``) is
``oscar_compile.formats.cache``, below the kernels and the quantizer that read it.
"""
