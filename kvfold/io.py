"""Filesystem helpers: hashing and all-or-nothing output directories."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvfold.errors import KVFoldError

__all__ = ["atomic_dir", "atomic_write_text", "sha256_file"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    """Write a file so readers see the old content or the new one, never a torn one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; outputs are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_dir(target: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temp directory beside `target`; on success it replaces `target`, on any failure
    (Ctrl-C included) it is removed, so no half-written output is ever left at `target`."""
    target = Path(target)
    if target.exists() and not force:
        raise KVFoldError(f"output '{target}' already exists; pass --force to replace it")
    if target.exists() and not target.is_dir():
        raise KVFoldError(f"output '{target}' exists and is not a directory; choose another path")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; outputs are meant to be shared
    try:
        yield tmp
        for f in tmp.rglob("*"):  # some writers (safetensors shards) make 0600 files; outputs are shared
            if f.is_file():
                os.chmod(f, 0o666 & ~_umask())
        # Swap in two renames; the old output is removed only once the new one is complete.
        old = None
        if target.exists():
            old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
            os.replace(target, old / "x")
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
