"""The import structure, read from the source with ``ast``: no cycles among trainer/ and orchestrator/
modules, no torch at module level on the orchestrator's side (the login node plans in a second), and the
trainer never imports the launcher's world."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from trainer import CONTRACT

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("trainer", "orchestrator", "hydra_plugins", "launch.py")  # the product: packages and launch.py


@dataclass
class Module:
    name: str
    top: set[str] = field(default_factory=set)  # imported at module level (runs on import)
    anywhere: set[str] = field(default_factory=set)  # imported at any level (function bodies too)
    dynamic: set[str] = field(default_factory=set)  # importlib.import_module / __import__ of a known string


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(node: ast.AST, package: str, known: set[str]) -> set[str]:
    """Dotted names an import statement depends on. ``from a import b`` depends on ``a.b`` when that is a
    module (Python imports the submodule even while ``a/__init__`` is still running, so a child importing
    a sibling through its package is no cycle) and on ``a`` itself otherwise (a name ``a/__init__``
    must already have defined)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        return {f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names}
    return set()


def _text(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _name(node: ast.AST | None) -> str | None:
    """The name an expression reads: ``x`` of ``x``, ``NAME`` of ``self.NAME`` or ``Seam.NAME``."""
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def string_bindings(tree: ast.AST) -> dict[str, set[str]]:
    """Every string a name is bound to anywhere in a module: an assignment at any level (a module
    constant, a class attribute, a local), a parameter's default (``def load(name="tests.seam")``), and
    through another name (``name = self.NAME``). Attributes count by their last name."""
    out: dict[str, set[str]] = {}
    aliases: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        pairs: list[tuple[ast.AST, ast.AST | None]] = []
        if isinstance(node, ast.Assign):
            pairs = [(t, node.value) for t in node.targets]
        elif isinstance(node, ast.AnnAssign | ast.NamedExpr):
            pairs = [(node.target, node.value)]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            a = node.args
            positional = [*a.posonlyargs, *a.args]
            pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults, strict=True))
            pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None]
        for target, value in pairs:
            name = _name(target) or getattr(target, "arg", None)
            if name and (text := _text(value)) is not None:
                out.setdefault(name, set()).add(text)
            elif name and (source := _name(value)):
                aliases.append((name, source))
    changed = True
    while changed:  # through names bound to names, to the strings at the end
        changed = False
        for name, source in aliases:
            new = out.get(source, set()) - out.get(name, set())
            if new:
                out.setdefault(name, set()).update(new)
                changed = True
    return out


def _dynamic(tree: ast.Module) -> set[str]:
    """Modules named to ``importlib.import_module`` or ``__import__`` (first argument or ``name=``): a
    string literal, or a name bound to one anywhere in the module (``SEAM = "tests.seam"``, a parameter's
    default), the ways a static import walker is usually evaded."""
    bound = string_bindings(tree)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in (
                "import_module", "__import__"):
            args = [*node.args[:1], *(k.value for k in node.keywords if k.arg == "name")]
            for arg in args:
                text = _text(arg)
                out |= {text} if text is not None else bound.get(_name(arg), set())
    return out


def _module_level(tree: ast.Module) -> list[ast.AST]:
    """Statements that run on import: the body, into if/try/with blocks, not into defs or classes'
    methods (a ``TYPE_CHECKING`` block never runs)."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
            continue
        out.append(node)
        todo += [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
    return out


def scan(root: Path, packages: tuple[str, ...]) -> dict[str, Module]:
    mods: dict[str, Module] = {}
    sources = {}
    for pkg in packages:
        for path in [root / pkg] if pkg.endswith(".py") else sorted((root / pkg).rglob("*.py")):
            name = _module_name(root, path)
            mods[name] = Module(name)
            sources[name] = (path, path.name == "__init__.py")
    known = set(mods)
    for name, (path, is_pkg) in sources.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        package = name if is_pkg else name.rpartition(".")[0]
        for node in ast.walk(tree):
            mods[name].anywhere |= _imports(node, package, known)
        for node in _module_level(tree):
            mods[name].top |= _imports(node, package, known)
        mods[name].dynamic = _dynamic(tree)
    return mods


def _internal(mods: dict[str, Module], names: set[str], own: str) -> set[str]:
    return {n for n in names if n in mods and n != own}


def cycles(mods: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components (Tarjan) of more than one module, over module-level imports."""
    graph = {m: _internal(mods, mods[m].top, m) for m in mods}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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


def _parents(name: str) -> list[str]:
    """Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def loads_at_import(mods: dict[str, Module], start: str, external: str) -> list[str] | None:
    """The chain of module-level imports from ``start`` to the external package ``external``, if any."""
    seen, todo = {start}, [[start]]
    while todo:
        chain = todo.pop(0)
        here = chain[-1]
        for name in sorted(mods[here].top | set(_parents(here))):
            if name == external or name.startswith(external + "."):
                return [*chain, name]
            for step in [*_parents(name), name]:
                if step in mods and step not in seen:
                    seen.add(step)
                    todo.append([*chain, step])
    return None


# --- the rules on this repository ---

MODS = scan(REPO, PACKAGES)


def test_no_import_cycles():
    found = cycles(MODS)
    assert not found, "import cycles (module-level imports):\n" + "\n".join(" <-> ".join(c) for c in found)


def package_of(module: str) -> str:
    """trainer's subpackages are the units (trainer.checkpoint, trainer.convert, ...); a top-level module of
    trainer is its own unit; orchestrator is one."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "trainer" and len(parts) > 1 else parts[0]


def package_cycles(mods: dict[str, Module]) -> list[list[str]]:
    """Cycles between packages over every import (function-level ones too): a package that needs another
    which needs it back is one unit pretending to be two."""
    graph: dict[str, set[str]] = {}
    for m, mod in mods.items():
        graph.setdefault(package_of(m), set())
        graph[package_of(m)] |= {package_of(n) for n in _internal(mods, mod.anywhere, m)} - {package_of(m)}
    units = {p: Module(p, top=deps) for p, deps in graph.items()}
    return cycles(units)


def test_no_package_cycles():
    assert package_cycles(MODS) == []


def folder_of(module: str) -> str:
    """orchestrator's folders are its units (orchestrator.stages, orchestrator.checks, ...); a module left
    at its root (an entry point, or one whose path job scripts print) is a unit of its own."""
    return ".".join(module.split(".")[:2])


def folder_cycles(mods: dict[str, Module]) -> list[list[str]]:
    """Cycles between orchestrator's folders over every import (function-level and TYPE_CHECKING too): the
    folders are layers only if no folder needs one that needs it back."""
    graph: dict[str, set[str]] = {}
    for m, mod in mods.items():
        if m.startswith("orchestrator."):
            deps = {folder_of(n) for n in _internal(mods, mod.anywhere, m) if n.startswith("orchestrator.")}
            graph.setdefault(folder_of(m), set()).update(deps - {folder_of(m)})
    return cycles({f: Module(f, top=deps) for f, deps in graph.items()})


def test_no_folder_cycles_in_the_orchestrator():
    found = folder_cycles(MODS)
    assert not found, "folder cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_folder_cycles_count_every_import():
    mods = {"orchestrator.a.x": Module("orchestrator.a.x", anywhere={"orchestrator.b.y"}),
            "orchestrator.b.y": Module("orchestrator.b.y", anywhere={"orchestrator.a.z"}),  # TYPE_CHECKING
            "orchestrator.a.z": Module("orchestrator.a.z"), "orchestrator.c": Module("orchestrator.c"),
            "orchestrator.d": Module("orchestrator.d", anywhere={"orchestrator.a.x", "orchestrator.c"})}
    assert folder_cycles(mods) == [["orchestrator.a", "orchestrator.b"]]


def test_package_cycles_count_function_level_imports():
    mods = {"trainer.a.x": Module("trainer.a.x", anywhere={"trainer.b.y"}),
            "trainer.b.y": Module("trainer.b.y", anywhere={"trainer.a.z"}),  # e.g. inside a function
            "trainer.a.z": Module("trainer.a.z"), "trainer.c": Module("trainer.c", anywhere={"trainer.a.z"})}
    assert package_cycles(mods) == [["trainer.a", "trainer.b"]]


def test_orchestrator_loads_no_torch_at_import():
    chains = [c for m in MODS if m.startswith("orchestrator") if (c := loads_at_import(MODS, m, "torch"))]
    assert not chains, "module-level torch on the login node:\n" + "\n".join(" -> ".join(c) for c in chains)


# The facts the orchestrator shares with the trainer (trainer.CONTRACT lists them), and what they import:
# torch-free.
TORCH_FREE = (*CONTRACT, "trainer.config.model", "trainer.checkpoint.megatron_args", "trainer.health.config",
              "trainer.health.heartbeat")
# Where the orchestrator may import the rest of the trainer, inside a function: a stage's node callable
# (the trainer's entry points, in the job) and the checks that read inputs or the world with the
# trainer's own readers (the real reader is the oracle for "can the trainer read this").
ENTRY_POINTS = ("orchestrator.stages.", "orchestrator.checks.")


def contract_breaches(mods: dict[str, Module]) -> list[tuple[str, str]]:
    """(orchestrator module, trainer module) for each import of the trainer outside the contract, except
    function-level ones in the entry-point modules."""
    out = []
    for m, mod in mods.items():
        if not m.startswith("orchestrator"):
            continue
        for n in sorted(x for x in mod.anywhere if x.split(".")[0] == "trainer"):
            inside = n in CONTRACT or n.startswith("trainer.config.")  # the sections' own modules
            if not inside and (n in mod.top or not m.startswith(ENTRY_POINTS)):
                out.append((m, n))
    return sorted(out)


def test_the_orchestrator_imports_the_trainer_only_through_the_contract():
    assert contract_breaches(MODS) == []


def test_the_contract_rule_can_fail():
    mods = {"orchestrator.status": Module("orchestrator.status", {"trainer.run"}, {"trainer.run"}),
            "orchestrator.stages.train": Module("orchestrator.stages.train", anywhere={"trainer.run"}),
            "orchestrator.flow": Module("orchestrator.flow", anywhere={"trainer.restore.state"})}
    assert contract_breaches(mods) == [("orchestrator.flow", "trainer.restore.state"),
                                       ("orchestrator.status", "trainer.run")]


def imports_of_tests(mods: dict[str, Module]) -> list[tuple[str, str]]:
    """(product module, tests module) for each import of the tests, static or dynamic, at any level."""
    return sorted((m, n) for m in mods for n in mods[m].anywhere | mods[m].dynamic
                  if n.split(".")[0] == "tests")


def test_no_product_module_imports_the_tests():
    """The fault tests' plugin (tests/seam.py) is named by the tests themselves (trainer/faults.py)."""
    assert imports_of_tests(MODS) == []


# Ways a product module could load the tests (source → what the walker must find), and one that does not.
SPELLINGS = [
    ("def f():\n    import tests.seam\n", "tests.seam"),
    ("import importlib\nSEAM = 'tests.seam'\ndef f():\n    importlib.import_module(SEAM)\n", "tests.seam"),
    ("def f():\n    return __import__('tests')\n", "tests"),
    ("from importlib import import_module\nimport_module('tests.waits')\n", "tests.waits"),
    ("import importlib\nimportlib.import_module('pkg.m0')\nNAME = 'tests'\n", None),  # no import of tests
    ("import importlib\ndef load(plugin='tests.seam'):\n    return importlib.import_module(plugin)\n",
     "tests.seam"),  # a parameter's default
    ("import importlib\ndef load(*, plugin: str = 'tests.seam'):\n    return importlib.import_module("
     "name=plugin)\n", "tests.seam"),  # a keyword-only default, passed by keyword
    ("import importlib\nclass Seam:\n    NAME = 'tests.seam'\n    def load(self):\n"
     "        name = self.NAME\n        return importlib.import_module(name)\n", "tests.seam"),  # an alias
    ("import importlib\ndef f():\n    where = 'tests.faults'\n    importlib.import_module(where)\n",
     "tests.faults"),  # a local
]


def test_an_import_of_the_tests_is_found_however_spelled(tmp_path: Path):
    files = {f"pkg/m{i}.py": source for i, (source, _) in enumerate(SPELLINGS)}
    mods = _package(tmp_path, {**files, "pkg/__init__.py": "", "launch.py": "from tests import seam\n"},
                    ("pkg", "launch.py"))
    want = [(f"pkg.m{i}", found) for i, (_, found) in enumerate(SPELLINGS) if found]
    assert imports_of_tests(mods) == [("launch", "tests"), *want]


def test_the_shared_facts_load_no_torch():
    chains = [c for m in TORCH_FREE if (c := loads_at_import(MODS, m, "torch"))]
    assert not chains, "torch at import:\n" + "\n".join(" -> ".join(c) for c in chains)


def test_trainer_never_imports_the_launchers_world():
    bad = [(m, n) for m in MODS if m.startswith("trainer") for n in MODS[m].anywhere
           if n.split(".")[0] in ("hydra", "omegaconf", "submitit", "orchestrator")]
    assert not bad, bad


def test_model_never_imports_torch_distributed():
    bad = [(m, n) for m in MODS if m.startswith("trainer.model") for n in MODS[m].anywhere
           if n.startswith("torch.distributed") or n.startswith("trainer.parallel")]
    assert not bad, bad


# --- the walker itself, on synthetic packages (each rule must be able to fail) ---

def _package(tmp_path: Path, files: dict[str, str], packages: tuple[str, ...] = ("pkg",)
             ) -> dict[str, Module]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return scan(tmp_path, packages)


def test_walker_finds_a_package_init_cycle_and_ignores_function_level_imports(tmp_path: Path):
    mods = _package(tmp_path, {
        "pkg/__init__.py": "from pkg.a import f\nfrom pkg.c import h\nVALUE = 1\n",
        "pkg/a.py": "from pkg import VALUE\ndef f():\n    from pkg import b\n",
        "pkg/c.py": "from pkg import helper\nh = 1\n",  # a submodule through the package: no cycle
        "pkg/helper.py": "",
        "pkg/b.py": "def g():\n    import pkg.a\n",
    })
    assert cycles(mods) == [["pkg", "pkg.a"]]


def test_walker_follows_torch_through_module_level_imports_only(tmp_path: Path):
    mods = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/plan.py": "from pkg.util import x\ndef late():\n    import torch\n",
        "pkg/util.py": "from .deep import y\n",
        "pkg/deep.py": "import torch.nn\n",
        "pkg/clean.py": "def f():\n    import torch\n",
    })
    assert loads_at_import(mods, "pkg.plan", "torch") == ["pkg.plan", "pkg.util", "pkg.deep", "torch.nn"]
    assert loads_at_import(mods, "pkg.clean", "torch") is None
