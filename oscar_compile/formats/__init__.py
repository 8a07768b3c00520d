"""Formats below the kernels: the paged cache's layout and the named arguments of every oscar:: op."""
