"""Attention kernels by phase (issue 40 moves the flat ``kernels/attention_*`` modules here)."""
