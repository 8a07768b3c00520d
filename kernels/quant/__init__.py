"""The reference quantizer (``oscar_compile.quant``) as Triton device functions, bit-exact."""
