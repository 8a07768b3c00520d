"""Where ``LLM`` and ``compress`` used to live: ``oscar_compile.llm`` and ``oscar_compile.compress``.

Kept so ``from oscar_compile.runtime.llm import LLM`` keeps working; the runtime itself imports
neither (both assemble the runtime with the passes, a layer above it).
"""
from oscar_compile.compress import compress  # noqa: F401
from oscar_compile.llm import LLM, CompletionOutput, RequestOutput  # noqa: F401
