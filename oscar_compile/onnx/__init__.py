"""ONNX export with an INT2 KV cache, and the numpy + onnxruntime driver that runs it.

``oscar-compile export --format onnx`` (``export.export_onnx``, needs torch) writes the graphs;
``OnnxGenerator(dir)`` (``driver.py``, numpy and onnxruntime only) owns the cache and generates.
Importing this package imports numpy only.
"""
from .driver import Cache, LayerState, OnnxGenerator

__all__ = ["OnnxGenerator", "Cache", "LayerState"]
