"""oscar_compile: declarative INT2 KV-cache compression for Hugging Face causal LMs."""
__version__ = "0.1.0"
