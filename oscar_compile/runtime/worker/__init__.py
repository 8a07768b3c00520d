"""The device side: runners, step inputs, CUDA graphs, sampler, swapper, TP runner. Imports ``core`` types."""
