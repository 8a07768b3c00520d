"""Packaging guards: kernels/ never shadows Hugging Face's `kernels`; importing us is cheap; pyproject.toml
lists every package."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run_in_repo_root(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_repo_kernels_folder_is_not_a_top_level_package():
    assert not (REPO / "kernels" / "__init__.py").exists(), "kernels/ must stay a namespace folder"
    ours = str(REPO / "kernels")
    code = (
        "import importlib.util\n"
        "from transformers.utils import import_utils\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "print(import_utils.is_kernels_available(), spec is not None and spec.origin not in (None, 'namespace'),\n"
        f"      spec is not None and spec.origin is not None and spec.origin.startswith({ours!r}))\n"
    )
    available, regular_package, ours = _run_in_repo_root(code).split()
    assert ours == "False", "the repo's kernels/ folder shadows Hugging Face's `kernels` package"
    if _hf_kernels_installed():
        # run from the repo root, `import kernels` still finds the installed Hugging Face package
        assert regular_package == "True"
    else:
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


def _listed_packages() -> tuple[set[str], dict[str, str]]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(setuptools["packages"]), setuptools["package-dir"]


def _python_folders(root: Path, package: str) -> set[str]:
    """`package` and every folder below `root` that holds Python (an `__init__.py` or any `.py`):
    setuptools installs only the packages it is told of, and a folder left out of the list is
    missing from the wheel while the tests, run from the repo root, still import it."""
    found = {package}
    for source in root.rglob("*.py"):
        folder = source.parent
        if folder != root and "__pycache__" not in folder.parts:
            found.add(".".join([package, *folder.relative_to(root).parts]))
    return found


def test_pyproject_lists_every_package():
    listed, package_dir = _listed_packages()
    assert package_dir.get("oscar_compile.kernels") == "kernels"
    assert package_dir.get("oscar_compile.specs") == "specs"
    expected = (_python_folders(REPO / "oscar_compile", "oscar_compile")
                | _python_folders(REPO / "kernels", "oscar_compile.kernels") | {"oscar_compile.specs"})
    assert not expected - listed, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(expected - listed)}"
    assert not listed - expected, f"listed in pyproject.toml but no such package: {sorted(listed - expected)}"
