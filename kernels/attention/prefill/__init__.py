"""Prefill attention over the paged cache as stored (issue 39): no 16-bit copies of the history."""
