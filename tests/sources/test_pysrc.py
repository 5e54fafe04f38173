"""pysrc: the standard library's own source as code text, split by module (seeded, disjoint, stable)."""

import pytest

from kvfold.errors import KVFoldError
from kvfold.sources.text import SPLIT_SEED, Mixture, _seeded_split, pysrc_modules, pysrc_split, resolve_text


def test_the_splits_are_disjoint_modules_covering_the_stdlib():
    modules = pysrc_modules()
    assert len(modules) > 300 and "json.decoder" in modules and "collections.__init__" in modules
    assert not any(part in ("test", "tests", "idlelib") for name in modules for part in name.split(".")[:-1])
    names = {split: set(_seeded_split(sorted(modules), bounds)) for split, bounds in
             (("eval", (0.0, 0.1)), ("dev", (0.1, 0.2)), ("calib", (0.2, 1.0)))}
    assert sum(map(len, names.values())) == len(modules) == len(set.union(*names.values()))
    docs = {split: pysrc_split(split) for split in ("calib", "dev", "eval")}
    assert all(len(d) > 20 and sum(map(len, d)) > 300_000 for d in docs.values())
    assert not set(docs["dev"]) & set(docs["eval"]) and not set(docs["calib"]) & set(docs["eval"])
    assert any("def " in d for d in docs["eval"])  # it is code


def test_the_same_split_every_time_and_in_mixtures():
    assert resolve_text("pysrc:eval") == resolve_text("pysrc:eval") == pysrc_split("eval")
    assert resolve_text("pysrc") == pysrc_split("calib")
    mix = resolve_text("wiki:dev+pysrc:dev")
    assert isinstance(mix, Mixture) and mix.parts[1] == pysrc_split("dev")
    with pytest.raises(KVFoldError, match="use one of pysrc:eval, pysrc:dev, pysrc:calib"):
        resolve_text("pysrc:test")


def test_the_split_is_by_a_fixed_seed_over_sorted_names(tmp_path):
    # a tree of our own: which modules land in eval depends only on the sorted names and SPLIT_SEED
    for i in range(40):
        (tmp_path / f"m{i:02d}.py").write_text(f"def f{i}():\n    return {i}\n")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "test_x.py").write_text("skipped = True\n")
    (tmp_path / "bad.py").write_bytes(b"\xff\xfe not utf-8")
    assert len(pysrc_modules(tmp_path)) == 41  # bad.py is listed, then dropped when read
    evaluation = pysrc_split("eval", tmp_path)
    assert len(evaluation) == 4 and SPLIT_SEED == 20261101
    assert evaluation == pysrc_split("eval", tmp_path)
    assert all("skipped" not in d and "not utf-8" not in d for s in ("calib", "dev", "eval")
               for d in pysrc_split(s, tmp_path))
