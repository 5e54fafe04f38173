"""Package boundaries: the runtime never needs the compiler, and kvfold reaches the runtime only
through its public top-level API."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(folder: Path):
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                yield path, [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                yield path, [node.module]


def test_runtime_does_not_import_kvfold():
    bad = [(p, n) for p, names in _imports(ROOT / "runtime") for n in names if n.split(".")[0] == "kvfold"]
    assert not bad


def test_kvfold_uses_only_the_runtime_public_api():
    bad = [(p, n) for p, names in _imports(ROOT / "kvfold") for n in names
           if n.startswith("kvfold_runtime.")]
    assert not bad
