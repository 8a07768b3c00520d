"""Prefill attention over the compressed paged cache (decode-consistent and extend)."""
