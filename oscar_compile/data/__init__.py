"""Small pure-python data helpers shared by training and evaluation (needle-in-a-haystack)."""
from .needle import NeedleSample, TokenAdapter, make_needle_sample, needle_grid

__all__ = ["NeedleSample", "TokenAdapter", "make_needle_sample", "needle_grid"]
