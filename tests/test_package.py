"""Packaging guards: kernels/ never shadows Hugging Face's `kernels`; importing us is cheap."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run_in_repo_root(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_repo_kernels_folder_is_not_a_top_level_package():
    assert not (REPO / "kernels" / "__init__.py").exists(), "kernels/ must stay a namespace folder"
    code = (
        "import importlib.util\n"
        "from transformers.utils import import_utils\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "print(import_utils.is_kernels_available(), spec is not None and spec.origin not in (None, 'namespace'))\n"
    )
    available, regular_package = _run_in_repo_root(code).split()
    if not _hf_kernels_installed():
        # at most an empty namespace folder is visible, and transformers does not mistake it for the HF package
        assert regular_package == "False" and available == "False"


def _hf_kernels_installed() -> bool:
    import importlib.metadata

    try:
        importlib.metadata.version("kernels")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def test_kernels_import_as_a_subpackage_from_the_repo_root():
    path = _run_in_repo_root("import oscar_compile.kernels as k; print(list(k.__path__)[0])")
    assert Path(path).resolve() == (REPO / "kernels").resolve()


def test_import_is_cheap():
    code = (
        "import sys, oscar_compile\n"
        "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))\n"
    )
    assert _run_in_repo_root(code) == "[]"
