"""One line for CI's log: the versions a leg tested (a package not installed prints '-')."""
import importlib.metadata
import sys

PACKAGES = ("torch", "transformers", "kernels", "triton", "huggingface-hub", "fastapi", "xgrammar", "lm-eval",
            "openai", "onnx", "ray")


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "-"


print(f"python {sys.version.split()[0]}", *(f"{name} {_version(name)}" for name in PACKAGES))
