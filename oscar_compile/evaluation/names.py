"""Names the CLI needs before anything heavy is imported (no torch, no transformers here)."""

DEFAULT_METHODS = (
    "bf16", "naive-int2", "kivi-int2", "hadamard-int2", "oscar-int2",
    "oscar-int2-per-head", "oscar-int2-attn-output", "oscar-optr-int2", "oscar-int4",
)
BUILTIN_VARIANT_NAMES = ("oscar-int2-per-head", "oscar-int2-attn-output")
TASKS = ("layers", "perplexity", "agreement", "needle")
NEEDLE_MODES = ("context", "prompt")
