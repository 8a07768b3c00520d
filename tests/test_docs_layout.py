"""The README's layout and docs/architecture.md name every package folder of the tree: a folder
added without a word in them fails here."""
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _package_folders(root: Path) -> list[Path]:
    """Folders below ``root`` that hold Python (what a reader of the layout must find)."""
    folders = {p.parent for p in root.rglob("*.py") if "__pycache__" not in p.parts}
    return sorted(f.relative_to(root) for f in folders if f != root and not f.is_symlink())


def _layout_block() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Layout"):]
    return section[section.index("```"):section.index("```", section.index("```") + 3)]


FOLDERS = [("oscar_compile", f) for f in _package_folders(REPO / "oscar_compile") if f.parts[0] != "kernels"] + [
    ("kernels", f) for f in _package_folders(REPO / "kernels")]


@pytest.mark.parametrize("document", ["README.md", "docs/architecture.md"])
def test_every_package_folder_is_named(document):
    text = _layout_block() if document == "README.md" else (REPO / document).read_text()
    missing = [f"{top}/{folder.as_posix()}/" for top, folder in FOLDERS if f"{folder.name}/" not in text]
    assert not missing, f"{document} does not name these package folders: {missing}"
