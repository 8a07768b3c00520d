"""Decode attention over the compressed paged cache: the reference, the portable Triton kernel and
the Hopper Gluon kernels (fp16 operands; 8-bit integer dots), with their tiles."""
