"""The library version, in a module of its own so that the artifact writer can record it
without importing the package root."""

__version__ = "0.1.0"
