"""What a serving engine checks of an export folder before it loads the weights.

kvfold's manifest (kvfold.json) records the sha256 of every file `kvfold export` wrote; a runtime that
serves the folder checks, in order: the manifest is there and of a schema major it reads, the files it
lists are there and unchanged (sha256), no weight file is there that it does not list, and config.json's
`kvfold` block describes this model (kvfold_runtime.format). The first failure is one
ValueError whose message says what is wrong and what to do. (`kvfold verify` checks far more: shapes,
accuracy against the original, live cache bytes.)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvfold_runtime.format import MANIFEST, ConfigBlock, check_schema

__all__ = ["check_export", "tensor_shapes"]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def tensor_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the folder's safetensors files, read from their headers (no weight is read)."""
    from safetensors import safe_open

    shapes = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            shapes |= {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    return shapes


def check_export(folder: str | Path) -> dict:
    """The manifest of a kvfold export at `folder` after checking its files; ValueError on any failure."""
    folder = Path(folder)
    where = f"{folder}: "
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        raise ValueError(where + f"no {MANIFEST}: not a kvfold export (run kvfold export)") from None
    except (OSError, ValueError) as e:
        raise ValueError(where + f"{MANIFEST} is unreadable ({e}); re-export the model") from None
    check_schema(manifest.get("schema_version"), where)
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise ValueError(where + f"{MANIFEST} lists no files; re-export the model")
    for name, digest in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            raise ValueError(where + f"{name} is missing; re-export the model or restore the file")
        if _sha256(path) != digest:
            raise ValueError(where + f"{name} differs from the manifest (sha256): the export is corrupt or was "
                             "edited; re-export the model (`kvfold verify` names every difference)")
    config = ConfigBlock.from_dict(json.loads((folder / "config.json").read_text()).get("kvfold"))
    if config.d_k != manifest.get("d_k") or config.d_v != manifest.get("d_v"):
        raise ValueError(where + f"config.json's kvfold ranks differ from {MANIFEST}'s: the export was edited; "
                         "re-export the model")
    extra = sorted(p.name for p in folder.glob("*.safetensors") if p.name not in files)
    if extra:
        raise ValueError(where + f"weight files not in the manifest: {', '.join(extra)}; remove them or re-export")
    return manifest
