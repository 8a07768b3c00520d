"""The package's import rules, read from the source (nothing is imported).

- no import circles between modules, lazy (function-level) imports included: a circle is a
  layering mistake even when laziness keeps it from failing at import time;
- no circle between top-level units either (the folders and top-level modules under
  ``oscar_compile/``: ``cache``, ``kernels``, ``quant``, ``runtime``, ...), the compat shims aside:
  a unit sits wholly above or below another;
- ``runtime`` does not import ``passes`` (the graph-to-cache contract lives in ``cache``);
- ``kernels`` imports none of ``runtime``, ``passes``, ``evaluation`` or ``cache`` (the contract
  and the HF cache, which call the kernels);
- inside ``runtime``, imports go one way between its rooms: server -> engine (the modules at
  ``runtime/``) -> core / worker, worker -> core for types; ``core`` imports no torch;
- ``formats`` (the cache format and the ops' named arguments) imports nothing of the package but
  ``formats``: ``quant``, the kernels and ``cache`` all stand on it;
- no ``args[...]`` / ``node.args[...]`` read of an ``oscar::`` op's arguments, by index or by
  slice, outside ``formats/op_args.py``, which names them (and no kernel wrapper handed ``*args``);
- no ``_oscar_*`` or ``oscar_graph`` attribute set or read outside ``passes/``, by name or by
  string (``getattr`` / ``hasattr`` / ``setattr`` / ``__dict__``): what ``apply`` made travels in
  the handle it returns (passes/compressed_model.py), not on the model.

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
        "runtime": ("runtime", "cache", "formats", "kernels", "loading", "_version"),  # _version: one constant
        "cache": ("cache", "formats", "kernels", "quant"),
        "formats": ("formats",),
    }
    for layer, below in allowed.items():
        prefixes = tuple(f"{PACKAGE}.{b}" for b in below)
        edges = [f"{m} -> {t}" for m, ts in graph.items() if m.startswith(f"{PACKAGE}.{layer}")
                 and m not in COMPAT_SHIMS for t in ts if not t.startswith(prefixes)]
        assert edges == [], layer


def _runtime_room(module: str) -> str | None:
    """The runtime room a module sits in: core, worker, server, or the engine (the rest of
    ``runtime``); None outside the runtime and for the package itself."""
    runtime = f"{PACKAGE}.runtime"
    if not module.startswith(runtime + "."):
        return None
    first = module[len(runtime) + 1:].split(".")[0]
    return first if first in ("core", "worker", "server") else "engine"


def test_runtime_rooms_import_only_downward():
    """server -> engine -> core / worker (worker -> core for types), never back."""
    below = {"core": {"core"}, "worker": {"worker", "core"}, "engine": {"engine", "worker", "core"},
             "server": {"server", "engine", "worker", "core"}}
    graph = _graph()
    edges = [f"{m} -> {t}" for m, ts in graph.items() if _runtime_room(m) and m not in COMPAT_SHIMS
             for t in ts if _runtime_room(t) and _runtime_room(t) not in below[_runtime_room(m)]]
    assert edges == []


def test_runtime_core_imports_no_torch():
    """The scheduler's path holds no tensors (as nano-vllm keeps it): core runs without torch."""
    core = ROOT / PACKAGE / "runtime" / "core"
    found = []
    for path in sorted(core.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("torch", "triton", "numpy")]
    assert found == []


def test_formats_sit_below_everything():
    edges = _edges_between(_graph(), f"{PACKAGE}.formats", (PACKAGE,))
    assert [e for e in edges if not e.split(" -> ")[1].startswith(f"{PACKAGE}.formats")] == []


# Reads of ``args[...]`` / ``x.args[...]`` / a ``*varargs[...]`` that are not an oscar:: op's arguments: (file name, the
# expression as written) -> why. Keyed by file name, not path, so moving a file keeps its entries.
UNRELATED_ARGS_READS = {
    ("apply.py", "args[0]"): "the HF model forward's input_ids",
    ("backend.py", "sdpa.args[:3]"): "torch SDPA's q, k, v",
    ("backend.py", "sdpa.args[3:]"): "torch SDPA's remaining arguments, passed on unchanged",
    ("merge_projections.py", "n.args[0]"): "a Linear call's input",
    ("sites.py", "user.args[1]"): "operator.getitem's index",
    ("sites.py", "node.args[0]"): "Cache.update's call_method receiver",
    ("sites.py", "update.args[2]"): "HF Cache.update's value_states",
    ("sites.py", "attention.args[2]"): "the HF attention function's value",
    ("swap_attention.py", "u.args[1]"): "operator.getitem's index",
    ("op_constants.py", "node.args[1]"): "cache.nodes.layer_inputs' layer index (a graph node, not an oscar:: op)",
    ("graphs.py", "cache_flat[i * n:(i + 1) * n]"): "the ONNX graph's flat cache inputs, one layer's at a time",
}
OP_ARGS_MODULE = ROOT / PACKAGE / "formats" / "op_args.py"
# a call forwarding ``*args`` whole: an op's arguments go to a definition, others are named here
FORWARDS_ALLOWED = {
    ("jit_watch.py", "before"): "Triton's compile hook, chained",
    ("jit_watch.py", "after"): "Triton's compile hook, chained",
    ("testing.py", "write"): "a test's write call passed on as it came, with history_lens added",
    ("determinism.py", "func"): "a torch function mode passes every torch call on as it came",
    ("determinism.py", "batch_invariant_linear"): "F.linear's own arguments, as the mode received them",
    ("ops.py", "definition"): "an op's definition (its formats/op_args.py NamedTuple), handed to _triton_on_cuda",
    ("ops.py", "op"): "direct(): under torch.compile, the op called with the arguments it came with",
    ("ops.py", "cuda"): "direct(): the op's CUDA implementation, which binds them to its definition",
    ("ops.py", "default"): "direct(): the op's default implementation, which binds them to its definition",
}


def _package_sources() -> list[Path]:
    """Every source file of the package (kernels read once, from the top-level folder)."""
    return sorted(_modules().values())


def _is_args(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "args") or (isinstance(node, ast.Attribute)
                                                                   and node.attr == "args")


def _varargs_names(tree: ast.AST) -> dict[ast.AST, str]:
    """Each ``*name`` parameter's uses: the Name nodes inside its function that read it."""
    uses = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and fn.args.vararg:
            name = fn.args.vararg.arg
            uses.update({n: name for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == name})
    return uses


def _positional_args_reads(path: Path) -> list[str]:
    """``args[...]`` / ``x.args[...]`` / ``rest[...]`` (of a ``*rest`` parameter) reads in a file
    that are not allow-listed, as ``file:line: expr``."""
    source = path.read_text()
    tree = ast.parse(source)
    varargs = _varargs_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and (_is_args(node.value) or node.value in varargs):
            text = ast.get_source_segment(source, node)
            if (path.name, text) not in UNRELATED_ARGS_READS:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
        elif isinstance(node, ast.Call) and any(isinstance(a, ast.Starred) and _is_args(a.value) for a in node.args):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if not name.endswith("Args") and (path.name, name) not in FORWARDS_ALLOWED and "kernels" in path.parts:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}(*args)")
    return found


def test_op_arguments_are_read_by_name():
    """An op's arguments are bound through its definition (formats/op_args.py), never counted: one
    added argument would shift every index silently."""
    reads = [r for path in _package_sources() if path != OP_ARGS_MODULE for r in _positional_args_reads(path)]
    assert reads == []


def test_allow_listed_args_reads_still_exist():
    """A stale allow-list entry would let a new read of the same text through unseen."""
    sources: dict[str, str] = {}
    for path in _package_sources():
        sources[path.name] = sources.get(path.name, "") + path.read_text()
    stale = [key for key in UNRELATED_ARGS_READS if key[1] not in sources.get(key[0], "")]
    assert stale == []


PASSES = ROOT / PACKAGE / "passes"


def _model_attribute_uses(source: str, label: str) -> list[str]:
    """Attribute accesses and string literals naming ``oscar_graph`` or an ``_oscar_*`` attribute,
    as ``label:line: name``, in line order."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value
        else:
            continue
        if name == "oscar_graph" or name.startswith("_oscar_"):
            found.append((node.lineno, node.col_offset, f"{label}:{node.lineno}: {name}"))
    return [use for *_, use in sorted(found)]


def test_only_the_passes_touch_oscar_attributes_of_a_model():
    """The model is not a notice board: the runner, the checkpoint, the tensor-parallel split and
    the benches are handed apply()'s handle, and no one else finds state on the model."""
    uses = [u for path in _package_sources() if PASSES not in path.parents
            for u in _model_attribute_uses(path.read_text(), str(path.relative_to(ROOT)))]
    assert uses == []


def test_the_attribute_rule_sees_each_way_of_reaching_an_attribute():
    """The scan above can fail: a plain read, a hasattr by string, a __dict__ lookup and a write."""
    source = ("r = model._oscar_compile_report\n"
              "hasattr(model, '_oscar_x')\n"
              "attn.__dict__.get('oscar_graph')\n"
              "model._oscar_tensor_parallel = report\n"
              "name = '_oscar'  # not an attribute name\n")
    assert [u.rsplit(": ", 1)[1] for u in _model_attribute_uses(source, "probe")] == [
        "_oscar_compile_report", "_oscar_x", "oscar_graph", "_oscar_tensor_parallel"]


# The one read of the environment under kernels/ besides TRITON_INTERPRET (which Triton itself
# reads at import): the attention kernel setting, read when a dispatch is built.
ENVIRONMENT_READERS = {("attention_dispatch.py", "attention_kernel_from_env")}


def _environment_reads(path: Path, source: str) -> list[str]:
    """``os.environ`` / ``os.getenv`` / ``environ`` uses in ``source``, as ``file:line: function``,
    but those that read ``TRITON_INTERPRET`` (a string constant key) and those of
    ``ENVIRONMENT_READERS``."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def reads_triton_interpret(node: ast.AST) -> bool:
        for above in (parents.get(node), parents.get(parents.get(node))):
            keys = (above.args[:1] if isinstance(above, ast.Call) else [above.slice]
                    if isinstance(above, ast.Subscript) else [])
            if any(isinstance(k, ast.Constant) and k.value == "TRITON_INTERPRET" for k in keys):
                return True
        return False

    def function_of(node: ast.AST) -> str:
        while node in parents:
            node = parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node.name
        return "<module>"

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os" and \
                any(a.name in ("environ", "getenv", "getenvb", "environb") for a in node.names):
            found.append(f"{path}:{node.lineno}: from os import ...")
        elif (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "getenvb", "environb")
              and isinstance(node.value, ast.Name) and node.value.id == "os"):
            if reads_triton_interpret(node if node.attr.startswith("getenv") else parents.get(node)):
                continue
            if (path.name, function_of(node)) not in ENVIRONMENT_READERS:
                found.append(f"{path}:{node.lineno}: {function_of(node)}")
    return found


def test_kernels_read_the_environment_in_one_place():
    """The attention setting is read once, by the dispatch (``attention_kernel_from_env``), never
    at a call: a kernel that read ``os.environ`` per layer would change its choice mid-run."""
    kernels = ROOT / "kernels"
    found = [r for path in sorted(kernels.rglob("*.py"))
             for r in _environment_reads(path.relative_to(ROOT), path.read_text())]
    assert found == []
    readers = [r for path in sorted(kernels.rglob("attention_dispatch.py"))
               for r in _environment_reads(path.relative_to(ROOT), path.read_text().replace(
                   "def attention_kernel_from_env", "def renamed"))]
    assert len(readers) == 1, readers  # the allowed reader is there, and the rule sees it


def test_the_environment_rule_catches_a_read():
    source = ("import os\nfrom os import environ\n"
              "def choose():\n    return os.environ.get('OSCAR_ATTENTION_KERNEL')\n"
              "def flag():\n    return os.getenv('X'), os.environ['Y']\n"
              "def interpreting():\n"
              "    return os.environ.get('TRITON_INTERPRET') == '1', os.getenv('TRITON_INTERPRET')\n")
    assert _environment_reads(Path("kernels/x.py"), source) == [
        "kernels/x.py:2: from os import ...", "kernels/x.py:4: choose", "kernels/x.py:6: flag", "kernels/x.py:6: flag"]


def test_no_flat_attention_module_at_the_top_of_kernels():
    """Attention lives in ``kernels/attention/`` (decode/, prefill/, the plans and the dispatch)."""
    flat = sorted(p.name for p in (ROOT / "kernels").glob("attention*.py"))
    assert flat == []
    assert (ROOT / "kernels" / "attention" / "attention_dispatch.py").is_file()
