"""The frontier command end to end on a tiny model, and how the compression at the target is read."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from kvfold_bench.cli import app
from kvfold_bench.frontier.sweep import Point, at_target, meets


def _p(kv: float, ratio: float) -> Point:
    return Point(knob=0.0, kv_fraction=kv, top1_ratio=ratio, top1_se=0.0, ppl_ratio=ratio)


def test_compression_at_target_interpolates_to_the_first_crossing():
    pts = [_p(0.8, 0.98), _p(0.9, 0.995), _p(0.95, 1.0), _p(0.7, 0.995)]  # the last recovers: ignored
    assert at_target(pts, 0.99, None) == pytest.approx(0.9 + (0.995 - 0.99) / (0.995 - 0.98) * (0.8 - 0.9))
    assert at_target([_p(0.9, 0.95)], 0.99, None) == 1.0  # one point under the target: no compression
    assert at_target([_p(0.9, 0.95), _p(0.95, 0.97)], 0.99, None) == pytest.approx(1 - 0.05 * 0.01 / 0.03)
    assert at_target([_p(0.6, 0.999), _p(0.5, 0.995)], 0.99, None) == 0.5  # never falls under: its last point
    fp8 = _p(0.5, 0.996)
    assert at_target([_p(0.45, 0.986)], 0.99, fp8) == pytest.approx(0.5 - 0.05 * 0.6)  # starts from fp8
    assert at_target([_p(0.45, 0.999)], 0.99, _p(0.5, 0.98)) is None  # its origin already misses


def test_the_joint_target_stops_at_whichever_bound_fails_first():
    def q(kv, top1, ppl):
        return Point(knob=0.0, kv_fraction=kv, top1_ratio=top1, top1_se=0.0, ppl_ratio=ppl)

    pts = [q(0.9, 0.999, 1.005), q(0.8, 0.995, 1.0301)]  # top-1 holds at 0.8, perplexity does not
    assert at_target(pts, 0.99, None) == 0.8
    t = (1 / 0.99 - 1.005) / (1.0301 - 1.005)  # where ppl crosses 1/0.99 between 0.9 and 0.8
    assert at_target(pts, 0.99, None, joint=True) == pytest.approx(0.9 - 0.1 * t)
    assert at_target([q(0.9, 0.98, 1.0)], 0.99, None, joint=True) == 1.0


def test_the_target_holds_only_where_it_holds_on_every_text_of_the_mixture():
    def q(kv, top1, ppl, parts=()):
        return Point(knob=0.0, kv_fraction=kv, top1_ratio=top1, top1_se=0.0, ppl_ratio=ppl, parts=parts)

    # pooled, both points pass; the second text's perplexity crosses 1/0.99 between them
    pts = [q(0.9, 0.999, 1.002, (q(0.9, 0.999, 1.001), q(0.9, 0.999, 1.006))),
           q(0.8, 0.995, 1.008, (q(0.8, 0.995, 1.002), q(0.8, 0.995, 1.0141)))]
    t = (1 / 0.99 - 1.006) / (1.0141 - 1.006)
    assert at_target(pts, 0.99, None, joint=True) == pytest.approx(0.9 - 0.1 * t)
    assert at_target([replace(p, parts=()) for p in pts], 0.99, None, joint=True) == 0.8  # pooled alone: passes
    assert meets(pts[0], 0.99) and not meets(pts[1], 0.99) and meets(pts[1], 0.99, joint=False)
    # the first point already fails on one text: interpolated from the original (1.0 on every text)
    t = (1 / 0.99 - 1.0) / (1.0141 - 1.0)
    worse = q(0.7, 0.98, 1.03, (q(0.7, 0.98, 1.02), q(0.7, 0.98, 1.04)))
    assert at_target([pts[1], worse], 0.99, None, joint=True) == pytest.approx(1.0 - 0.2 * t)


def test_frontier_command_writes_json_and_png(tiny_dirs, tmp_path):
    model = str(tiny_dirs["LlamaForCausalLM"])
    out, png = tmp_path / "f.json", tmp_path / "f.png"
    res = CliRunner().invoke(app, [
        "frontier", "--model", model, "--method", "kvfold+fp8", "--method", "think",
        "--eval-tokens", "1024", "--calib-tokens", "1024", "--calib-text", "wiki:calib+pysrc:calib",
        "--sensitivity-tokens", "512", "--multiple", "1", "--json", str(out), "--png", str(png)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    (m,) = report["models"]
    # 256-token windows (the tiny model's whole context): 4 windows, 1,020 scored tokens
    assert m["model"] == model and m["num_kv_heads"] == 2 and m["eval_tokens"] == 1024 - 4
    assert [r["name"] for r in m["methods"]] == ["fp8", "kvfold+fp8", "think"]  # fp8 added: the origin
    for row in m["methods"]:
        assert row["points"] and all(0 < p["kv_fraction"] <= 1 for p in row["points"])
        # scored on wiki:eval+pydoc:eval by default: each point also per text, the target read on every one
        assert all(len(p["parts"]) == 2 for p in row["points"])
    assert report["eval_text"] == "wiki:eval+pydoc:eval" and "each of its texts" in report["joint_target"]
    assert report["calib_text"] == "wiki:calib+pysrc:calib"  # a code model calibrates on code too, as its export
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json", "f.png"]  # no temp files left


def test_frontier_at_a_longer_context_with_passkey_retrieval(tiny_dirs, tmp_path):
    import shutil

    model = tmp_path / "long"  # the tiny Llama with room for 1,024-token prompts (RoPE takes any position)
    shutil.copytree(tiny_dirs["LlamaForCausalLM"], model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    out = tmp_path / "f.json"
    res = CliRunner().invoke(app, [
        "frontier", "--model", str(model), "--method", "fp8", "--accuracy", "0.5", "--context", "1024",
        "--passkey", "1024", "--eval-tokens", "2048", "--calib-tokens", "1024", "--sensitivity-tokens", "512",
        "--json", str(out), "--png", str(tmp_path / "f.png")])
    assert res.exit_code == 0, res.output
    (m,) = json.loads(out.read_text())["models"]
    assert m["context"] == 1024 and m["eval_tokens"] == 2048 - 2  # two 1,024-token windows
    assert m["passkey_original"]["prompts"] == 10 and 1000 < m["passkey_original"]["context"] <= 1024
    (fp8,) = m["methods"]
    assert fp8["passkey_at_best_passing"]["kv_fraction"] == 0.5 and fp8["passkey_at_best_passing"]["prompts"] == 10
    # beside the count, the answers' NLL: the original's, and the method's change against it, paired by prompt
    assert set(m["passkey_original"]["answer_nll"]) == {"mean", "se"}
    assert "answer_nll_change" not in m["passkey_original"]
    change = fp8["passkey_at_best_passing"]["answer_nll_change"]
    assert change["se"] > 0 and abs(change["mean"]) < 1
    # read as export reads its own: the tiny model retrieves no key, so fp8's one passing point keeps them all,
    # judged under export's roundings (fp8 rounds: three draws)
    assert fp8["kv_fraction_at_joint_target_with_passkeys"] == 0.5
    (check,) = fp8["passkey_checks"]
    assert check["kept"] and check["kv_fraction"] == 0.5 and len(check["retrieved"]) == 3
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the reading ringed, in the legend


def test_frontier_scores_long_windows_from_a_position_with_a_recent_window(tiny_dirs, tmp_path):
    """Issue 51 through the CLI: --context 256 --score-from 64 scores each window's last 192 tokens only, and
    int4:s4w16 (int4 with its first 4 and last 16 tokens whole) lands between int4 and the original."""
    model = str(tiny_dirs["LlamaForCausalLM"])
    out = tmp_path / "f.json"
    res = CliRunner().invoke(app, [
        "frontier", "--model", model, "--method", "int4", "--method", "int4:s4w16", "--context", "256",
        "--score-from", "64", "--eval-tokens", "1024", "--calib-tokens", "1024", "--sensitivity-tokens", "512",
        "--json", str(out)])
    assert res.exit_code == 0, res.output
    (m,) = json.loads(out.read_text())["models"]
    assert m["score_from"] == 64 and m["eval_tokens"] == 4 * (256 - 64)
    alone, recent = ((row["name"], row["points"][0]) for row in m["methods"])
    assert (alone[0], recent[0]) == ("int4", "int4:s4w16")
    assert alone[1]["kv_fraction"] < recent[1]["kv_fraction"] < 1 and recent[1]["kv_fraction_32k"] < recent[1][
        "kv_fraction"]
    assert 0 < recent[1]["kl"] < alone[1]["kl"]


@pytest.mark.parametrize("args, message", [
    (["--method", "nope"], "unknown method nope"),
    (["--json", "/nonexistent/x.json"], "does not exist"),
    (["--eval-tokens", "512"], "at least twice --context"),
    (["--accuracy", "1.5"], "--accuracy must be in (0, 1]"),
    (["--multiple", "0"], "--multiple at least 1"),
    (["--score-from", "512"], "--score-from must be at least 1 and less than --context (512)"),
    (["--calib-text", "wiki:nope"], "unknown text split 'wiki:nope'"),
    (["--model", "/nonexistent"], "does not exist"),
])
def test_frontier_bad_input_is_one_line_and_writes_nothing(tiny_dirs, tmp_path, args, message):
    res = CliRunner().invoke(app, ["frontier", "--model", str(tiny_dirs["LlamaForCausalLM"]),
                                   "--png", str(tmp_path / "f.png"), *args])
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output
    assert list(tmp_path.iterdir()) == []


def test_a_method_that_cannot_run_fails_before_any_work(tiny_dirs, tmp_path):
    res = CliRunner().invoke(app, ["frontier", "--model", str(tiny_dirs["GPT2LMHeadModel"]),
                                   "--method", "fp8", "--method", "palu", "--json", str(tmp_path / "f.json")])
    assert res.exit_code == 2 and "palu needs RoPE" in res.output and "Traceback" not in res.output
    assert list(tmp_path.iterdir()) == []
