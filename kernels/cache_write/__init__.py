"""``oscar::cache_write``: quantize new tokens into the paged cache; the reference and the Triton kernel."""
