"""The package's import rules, read from the source (nothing is imported).

- no import circles between modules, lazy (function-level) imports included: a circle is a
  layering mistake even when laziness keeps it from failing at import time;
- no circle between top-level units either (the folders and top-level modules under
  ``oscar_compile/``: ``cache``, ``kernels``, ``quant``, ``runtime``, ...), the compat shims aside:
  a unit sits wholly above or below another;
- ``runtime`` does not import ``passes`` (the graph-to-cache contract lives in ``cache``);
- ``kernels`` imports none of ``runtime``, ``passes``, ``evaluation`` or ``cache`` (the contract
  and the HF cache, which call the kernels);
- ``formats`` (the cache format) imports nothing of the package: ``quant``, the kernels and
  ``cache`` all stand on it.

A package's ``__init__`` counts as importing nothing but what it names itself; ``import a.b.c``
depends on ``a.b.c`` only, not on every package above it.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "oscar_compile"


def _modules() -> dict[str, Path]:
    found = {}
    for base, prefix in ((ROOT / PACKAGE, PACKAGE), (ROOT / "kernels", f"{PACKAGE}.kernels")):
        for path in sorted(base.rglob("*.py")):
            if prefix == PACKAGE and (base / "kernels") in path.parents:
                continue  # the kernels symlink: read once, from the top-level folder
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                root = ".".join(base + ([node.module] if node.module else []))
            else:
                root = node.module
            targets = [f"{root}.{alias.name}" for alias in node.names] + [root]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith(PACKAGE):
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    for name in graph:  # a package named as "from pkg import x" where x is a submodule: drop pkg
        graph[name] = {t for t in graph[name] if not (modules[t].name == "__init__.py" and
                                                      any(u.startswith(t + ".") for u in graph[name]))}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _edges_between(graph, source: str, targets: tuple[str, ...]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith(source)
                  for t in ts if t.startswith(targets))


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_runtime_does_not_import_passes():
    assert _edges_between(_graph(), f"{PACKAGE}.runtime", (f"{PACKAGE}.passes",)) == []


def test_kernels_import_no_layer_above_them():
    above = tuple(f"{PACKAGE}.{p}" for p in ("runtime", "passes", "evaluation", "cache"))
    assert _edges_between(_graph(), f"{PACKAGE}.kernels", above) == []


# kept so promised import paths and `python -m` commands keep working; each only re-exports
COMPAT_SHIMS = {f"{PACKAGE}.runtime.llm", f"{PACKAGE}.runtime.serve"}


def _unit(module: str) -> str:
    """The top-level unit of a module: ``oscar_compile.cache.contract`` -> ``oscar_compile.cache``."""
    return ".".join(module.split(".")[:2])


def test_no_circle_between_top_level_units():
    units: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        if module in COMPAT_SHIMS:  # each re-exports from above on purpose
            continue
        units.setdefault(_unit(module), set()).update(_unit(t) for t in targets if _unit(t) != _unit(module))
    assert _cycles(units) == []


def test_runtime_and_cache_reach_only_below_themselves():
    graph = _graph()
    allowed = {
        "runtime": ("runtime", "cache", "formats", "kernels", "loading"),
        "cache": ("cache", "formats", "kernels", "quant"),
        "formats": ("formats",),
    }
    for layer, below in allowed.items():
        prefixes = tuple(f"{PACKAGE}.{b}" for b in below)
        edges = [f"{m} -> {t}" for m, ts in graph.items() if m.startswith(f"{PACKAGE}.{layer}")
                 and m not in COMPAT_SHIMS for t in ts if not t.startswith(prefixes)]
        assert edges == [], layer
