"""Batch-invariant ``x @ w.T + b`` for deterministic mode: the reference and the Triton kernel."""
