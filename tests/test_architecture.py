"""The package layout is the architecture: imports point one way, and the repository is self-contained.

Layers of ``src/jagg``: ``LAYERS`` below, top first (docs/architecture.md describes each package). A module
may import from its own package and from the layers below it, never from a layer above, and never from a
sibling on its own line (siblings are independent of each other).

``jagg`` itself (``src/jagg/__init__.py``) re-exports the engine's public API; no module of the package
imports it. Every ``import`` / ``from ... import`` is checked, including those inside functions, with
relative imports resolved, and imports under ``if TYPE_CHECKING:`` count like any other (a type-only import
still ties two modules together). ``importlib.import_module`` with a literal ``jagg`` name counts as an import
too. There must also be no import cycle between modules, inside a package or across packages. The trainer
imports no instrument: it knows the plug-in surface and the registry (``jagg.plugins``), not a plug-in.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "jagg"

LAYERS = [  # top first; the packages on one line are siblings
    ["jagg.loop"],
    ["jagg.capacity"],
    ["jagg.ops"],
    ["jagg.world", "jagg.scale", "jagg.integrations"],
    ["jagg.config"],
    ["jagg.plugins"],  # below the config, which composes their sections from the registry
    ["jagg.engine", "jagg.models", "jagg.rewards"],
    ["jagg.errors", "jagg.common", "jagg.distributed", "jagg.stats"],
]
# the CLIs stay at their paths (`python -m jagg.train`, `python -m jagg.launch`), in the top layer
MEMBERS = {"jagg.train": "jagg.loop", "jagg.launch": "jagg.loop"}
PUBLIC_API = "jagg"  # the package __init__: may import the engine (and below) only
LEVEL = {c: i for i, line in enumerate(reversed(LAYERS)) for c in line}  # 0 = bottom


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _component(module: str) -> str:
    if module == PUBLIC_API:
        return PUBLIC_API
    for name, comp in MEMBERS.items():
        if module == name or module.startswith(name + "."):
            return comp
    for comp in LEVEL:
        if module == comp or module.startswith(comp + "."):
            return comp
    raise AssertionError(f"{module} belongs to no layer: add its package to LAYERS in {Path(__file__).name}")


def _walk(node: ast.AST):
    """Every node below ``node``, the bodies of ``if TYPE_CHECKING:`` blocks included."""
    return ast.walk(node)


def _resolve(target: str) -> str:
    """The longest known module that ``target`` names (``jagg.x.y`` where y is an attribute -> ``jagg.x``)."""
    while target not in MODULES and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


def imports_of(module: str) -> list[tuple[int, str]]:
    """(line, imported jagg module) for every import in ``module``, relative ones resolved."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in _walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [f"{mod}.{a.name}" for a in node.names]  # a submodule, or an attribute of ``mod``
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        for name in names:
            if name == "jagg" or name.startswith("jagg."):
                out.append((node.lineno, _resolve(name)))
    return out


def test_every_module_belongs_to_a_layer():
    for module in MODULES:
        _component(module)


def test_imports_point_down_the_layers():
    bad = []
    for module in MODULES:
        src = _component(module)
        for line, target in imports_of(module):
            dst = _component(target)
            if dst == src:
                continue
            if dst == PUBLIC_API:
                ok = False  # the re-exports are for users, not for the package itself
            elif src == PUBLIC_API:
                ok = LEVEL[dst] <= LEVEL["jagg.engine"]
            else:
                ok = LEVEL[dst] < LEVEL[src]
            if not ok:
                bad.append(
                    f"{MODULES[module].relative_to(ROOT)}:{line}: {module} ({src}) imports {target} ({dst})"
                )
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = {m: sorted({t for _, t in imports_of(m) if t != m}) for m in MODULES}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in graph[m]:
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t) :] + [t]))
            elif t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_config_names_the_backbones_without_importing_them():
    from jagg.config import BACKBONE_NAMES
    from jagg.models import BACKBONES

    assert sorted(BACKBONE_NAMES) == sorted(BACKBONES)


def test_loading_a_config_imports_neither_world_scale_nor_diffusers():
    code = (
        "import sys\n"
        "from jagg.config import load_config\n"
        "load_config('configs/paper/flux_dancegrpo.yaml')\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] == 'diffusers' or m.startswith(('jagg.world', "
        "'jagg.scale', 'jagg.loop', 'jagg.models'))]\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


# Files outside the repository that text here must not send a reader to (built from parts so that this file
# passes its own check).
FOREIGN = ["PAPER" + ".md", "REFERENCE" + ".md", "STYLE" + ".md", "../" + "shared"]
SCANNED = ["src/jagg", "tests", "experiments", "configs", "notebooks", "README.md", "Makefile"]


def _text_files():
    for entry in SCANNED:
        p = ROOT / entry
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file() and "__pycache__" not in f.parts and ".ipynb_checkpoints" not in f.parts:
                yield f


@pytest.mark.parametrize("name", FOREIGN)
def test_no_reference_to_files_outside_the_repository(name):
    hits = []
    for f in _text_files():
        rel = f.relative_to(ROOT).as_posix()
        try:
            text = f.read_text()
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if name in line:
                hits.append(f"{rel}:{i}: {line.strip()[:120]}")
    assert not hits, f"{name} is not part of this repository:\n" + "\n".join(hits)


# The plug-in surface and the registry: all the trainer may know of its instruments (docs/architecture.md).
PLUGIN_SURFACE = {"jagg.plugins", "jagg.plugins.base"}


def test_the_trainer_imports_no_instrument():
    """A new instrument is a plug-in plus one line in ``jagg.plugins.PLUGINS``: the trainer imports the
    registry and the surface, never a plug-in module, and no instrument lives in ``jagg.loop``."""
    bad = [
        f"line {line}: {target}"
        for line, target in imports_of("jagg.loop.trainer")
        if target.startswith("jagg.plugins") and target not in PLUGIN_SURFACE
    ]
    assert not bad, "the trainer imports instruments:\n" + "\n".join(bad)
    assert "jagg.loop.fidelity" not in MODULES and "jagg.engine.control" not in [
        t for _, t in imports_of("jagg.loop.trainer")
    ]


def test_loop_holds_the_loop_only():
    """``jagg.loop`` keeps the loop (at most 12 modules); run operations, the capacity plan and the plug-ins
    have packages of their own."""
    files = sorted(p.name for p in (SRC / "loop").glob("*.py"))
    assert len(files) <= 12, files
    assert not [p for p in (SRC / "loop").iterdir() if p.is_dir() and p.name != "__pycache__"]


def test_the_concept_table_names_everything_one_iteration_meets():
    """docs/architecture.md counts the concepts of one iteration by hand; every name the mechanical walk of the
    trainer finds (experiments/count_concepts.py) must be in that table, and the table holds at most 25."""
    import re

    sys.path.insert(0, str(ROOT / "experiments"))
    from count_concepts import iteration_names

    doc = (ROOT / "docs" / "architecture.md").read_text()
    table = doc[doc.index("**Now: ") : doc.index("**Before the plug-in refactor")]
    rows = [line for line in table.splitlines() if re.match(r"\| \d+ \|", line)]
    stated = int(re.search(r"\*\*Now: (\d+) concepts", table).group(1))
    assert len(rows) == stated <= 25
    in_table = set(re.findall(r"`([A-Za-z_]+)`", "\n".join(rows)))
    missing = sorted(set(iteration_names()) - in_table)
    assert not missing, (
        f"names one iteration meets that docs/architecture.md's table does not place: {missing}"
    )


def test_the_architecture_doc_lists_the_registered_plugins():
    """docs/architecture.md's row of ``jagg.plugins`` names the package's modules (the surface, then one per
    plug-in module of ``PLUGINS``, in registry order) and the registry's classes in the order they act, so a
    plug-in added to or dropped from ``PLUGINS`` without the docs fails here."""
    import re

    from jagg.plugins import PLUGINS

    doc = (ROOT / "docs" / "architecture.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `jagg.plugins` |"))
    modules = re.findall(r"`(\w+)`", row.split("|")[2])
    plugin_modules = list(dict.fromkeys(cls.__module__.rsplit(".", 1)[1] for cls in PLUGINS))
    assert modules == ["base", *plugin_modules]
    assert sorted(p.stem for p in (SRC / "plugins").glob("*.py") if p.stem != "__init__") == sorted(modules)
    listed = re.search(r"the registry `PLUGINS` \(([^)]*)\)", row)
    assert listed, "the jagg.plugins row names the registry's classes: the registry `PLUGINS` (`A`, `B`, ...)"
    assert re.findall(r"`(\w+)`", listed.group(1)) == [cls.__name__ for cls in PLUGINS]
