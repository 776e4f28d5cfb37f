"""The names one training iteration meets in the trainer (docs/architecture.md, "Counting the concepts").

Starting at ``Trainer._next_iteration``, every ``Trainer`` method it calls is followed (transitively); the script
lists the ``jagg`` names those bodies use (imported names) and the trainer attributes they read or write, leaving
out the trainer's own methods. docs/architecture.md groups these names into concepts by hand; a test checks that
every name listed here appears in its table.

    python experiments/count_concepts.py [path/to/trainer.py]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

TRAINER = Path(__file__).resolve().parents[1] / "src" / "jagg" / "loop" / "trainer.py"


def iteration_names(path: Path = TRAINER, start: str = "_next_iteration") -> list[str]:
    """The sorted ``jagg`` names and trainer attributes met by the methods ``start`` reaches."""
    tree = ast.parse(path.read_text())
    imported = {
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jagg")
        for alias in node.names
    }
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    methods = {f.name: f for f in trainer.body if isinstance(f, ast.FunctionDef)}
    seen, todo, names = set(), [start], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for node in ast.walk(methods[name]):
            if isinstance(node, ast.Name) and node.id in imported:
                names.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                if node.attr in methods:
                    todo.append(node.attr)
                else:
                    names.add(node.attr)
    return sorted(names)


if __name__ == "__main__":
    found = iteration_names(Path(sys.argv[1]) if len(sys.argv) > 1 else TRAINER)
    print("\n".join(found))
    print(f"{len(found)} names", file=sys.stderr)
