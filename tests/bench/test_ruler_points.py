"""kvfold-bench ruler's comparison rows, from cells already held (no server, no lm-eval request)."""

import json

import pytest

from kvfold_bench.ruler import SERVER_DEFAULT, _points, ruler


def _cell(each: list[float]) -> dict:
    return {"score": sum(each) / len(each), "samples": len(each), "seconds": 1.0, "per_sample": each}


def test_the_difference_has_a_paired_standard_error():
    """Differences 0, −1, 0, 0: mean −0.25, their spread 0.5, over √4: 0.25 — 25 points."""
    scores = {"original": {"niah_single_1": {"4096": _cell([1, 1, 0, 1])}},
              "export": {"niah_single_1": {"4096": _cell([1, 0, 0, 1])}}}
    (row,) = _points(scores)
    assert row["export_minus_original_points"] == -25.0
    assert (row["export_higher"], row["original_higher"]) == (0, 1)
    assert row["difference_se_points"] == pytest.approx(25.0)


def test_a_held_json_gets_this_versions_rows_without_serving(tmp_path):
    """Every cell asked for is held: nothing is served, and rows written by an older version are brought up to date
    in place (a second call leaves the file as it is)."""
    path, export, original = tmp_path / "ruler.json", tmp_path / "E", tmp_path / "O"
    scores = {name: {"ruler_vt": {"4096": _cell(each)}} for name, each in (("original", [1, 1]), ("export", [1, 0]))}
    held = {"benchmark": "ruler", "harness": "x", "dtype": SERVER_DEFAULT, "export": str(export),
            "original": str(original), "samples": 2, "scores": scores, "points": [{"task": "ruler_vt", "length": 4096}]}
    path.write_text(json.dumps(held))
    report = ruler(export, original, ["ruler_vt"], [4096], 2, path)
    assert report["points"] == _points(scores) and json.loads(path.read_text()) == report
    stamp = path.stat().st_mtime_ns
    ruler(export, original, ["ruler_vt"], [4096], 2, path)
    assert path.stat().st_mtime_ns == stamp
