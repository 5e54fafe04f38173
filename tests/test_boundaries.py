"""Package boundaries: the runtime never needs the compiler, and kvfold reaches the runtime only
through its public top-level API."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(folder: Path):
    paths = [folder] if folder.is_file() else folder.rglob("*.py")
    for path in paths:
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


# The compiler's packages in pipeline order: a module may import from its own stage and the ones before, never
# from a later one. Shared foundations come first; the commands that run the whole pipeline last.
STAGES = [
    ("errors", "console", "progress", "io", "adapters", "sources", "hooks"),
    ("calib",),
    ("factors",),
    ("measure",),
    ("plan",),
    ("rewrite",),
    ("checkpoint",),
    ("verify",),
    ("export", "api", "report", "cli", "__main__"),
]
_STAGE = {name: i for i, names in enumerate(STAGES) for name in names}


def _stage(module: str) -> int | None:
    parts = module.split(".")
    return _STAGE.get(parts[1]) if parts[0] == "kvfold" and len(parts) > 1 else None


def test_no_import_from_a_later_pipeline_stage():
    bad = []
    for path, names in _imports(ROOT / "kvfold"):
        rel = path.relative_to(ROOT).with_suffix("")
        here = _stage(".".join(rel.parts)) if len(rel.parts) > 1 else None
        if rel.parts[-1] == "__init__" and len(rel.parts) == 2:
            continue  # kvfold/__init__.py: the version only
        assert here is not None, f"{path} is in no stage of STAGES"
        bad += [(str(rel), n) for n in names if (s := _stage(n)) is not None and s > here]
    assert not bad


def test_the_compiler_imports_neither_the_benches_nor_research():
    """The benches (bench/, kvfold_bench) and research/ build on the compiler, never the other way."""
    assert not [(p, n) for p, names in _imports(ROOT / "kvfold") for n in names
                if n.split(".")[0] in ("kvfold_bench", "research")]
