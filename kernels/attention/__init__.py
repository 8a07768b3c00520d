"""``oscar::attention`` and ``oscar::attention_bf16``: the kernels, their references, the launch plans
and the dispatch that picks one per call (``attention_dispatch``)."""
