"""The fused per-layer ops (``oscar::rms_norm``, ``oscar::rope``, ``oscar::silu_mul``) and
``oscar::rotate``: references and Triton kernels."""
