"""How codes sit in the pages and how they are read back: the code layouts, the in-register code
decode, and the dequantization of a cached history."""
