"""The paged KV cache, below the passes and the runtime that both use it.

- ``layout``: what the cache looks like (typed, torch-free): windows, pages, per-layer formats.
- ``contract``: the graph-to-cache protocol the rewritten attention graphs call.
- ``hf_cache``: the cache behind Hugging Face ``generate()``, one implementation of the contract
  (the runtime's ``StepCache`` is the other).
"""
