"""An export stopped part way and run again takes what it had measured from its journal (plan/journal.py): the
same checkpoint as an uninterrupted export, with each candidate and pass-key answer set measured once in all."""

import pytest

from kvfold.checkpoint.manifest import Manifest
from kvfold.measure import evaluate
from kvfold.measure.metrics import Metrics
from kvfold.plan import longrange
from kvfold.plan.journal import Journal
from tests.conftest import save_tiny, write_tiny_text
from tests.test_cli import run


class Stop(Exception):
    """The export's process killed part way."""


def _counting(monkeypatch, module, name: str, counts: dict, stop_after: dict):
    """Count the completed calls of module.name; raise Stop at the call after stop_after[name] of them."""
    real = getattr(module, name)

    def counted(*args, **kwargs):
        if counts[name] == stop_after.get(name, -1):
            raise Stop(name)
        out = real(*args, **kwargs)
        counts[name] += 1
        return out
    monkeypatch.setattr(module, name, counted)


def test_a_stopped_export_resumes_from_its_journal(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFOLD_CACHE", str(tmp_path / "cache"))
    model = save_tiny(tmp_path / "model", "LlamaForCausalLM", max_position_embeddings=1024)
    text = write_tiny_text(tmp_path / "eval.txt")
    assert run("calibrate", model, "-o", tmp_path / "calib", "--tokens", 512, "--seq-len", 64).exit_code == 0

    def export(out, stop_after: dict) -> tuple[dict, object]:
        counts = {"score_patches": 0, "passkey_answers": 0}
        with monkeypatch.context() as m:
            _counting(m, evaluate.Evaluator, "score_patches", counts, stop_after)
            _counting(m, longrange, "passkey_answers", counts, stop_after)
            result = run("export", model, "--calib", tmp_path / "calib", "--eval-text", text, "--eval-tokens", 256,
                         "--margin", 0, "--accuracy", 0.8, "--passkey", 512, "-o", out)
        return counts, result

    whole, result = export(tmp_path / "whole", {})
    assert result.exit_code == 0, result.output
    assert whole["score_patches"] >= 3 and whole["passkey_answers"] >= 2
    journals = tmp_path / "cache" / "journal"
    assert not list(journals.glob("*.jsonl"))  # written, then gone with the export done

    # stopped in the search after two candidates, then in the pass-key check after the original's answers
    first, stopped = export(tmp_path / "out", {"score_patches": 2})
    assert isinstance(stopped.exception, Stop) and not (tmp_path / "out").exists()
    second, stopped = export(tmp_path / "out", {"passkey_answers": 1})
    assert isinstance(stopped.exception, Stop) and not (tmp_path / "out").exists()
    assert len(list(journals.glob("*.jsonl"))) == 1
    third, result = export(tmp_path / "out", {})
    assert result.exit_code == 0, result.output
    assert "resuming from" in result.output

    # each measurement made once over the three runs, and the same checkpoint as the uninterrupted export's
    for name in whole:
        assert first[name] + second[name] + third[name] == whole[name], name
    a, b = Manifest.load(tmp_path / "whole"), Manifest.load(tmp_path / "out")
    assert (a.chosen, a.curve, a.passkey) == (b.chosen, b.curve, b.passkey)
    assert not list(journals.glob("*.jsonl"))


def test_a_journal_of_another_original_is_set_aside(tmp_path):
    """If the original scores differently now (other text, other arithmetic), nothing recorded is used."""
    path = tmp_path / "j.jsonl"
    base = Metrics(top1=0.5, nll=2.0, tokens=100, correct=(50,), window_tokens=(100,), window_nll=(200.0,))
    journal = Journal(path)
    journal.check_baseline(base)
    journal.answers("original", lambda: longrange.Answers([True], [0.1], [1.0]))
    path.write_text(path.read_text() + '{"key": "cut sh')  # a line cut short by a kill is skipped
    assert Journal(path).resumed == 2
    lines = []
    again = Journal(path, lines.append)
    again.check_baseline(Metrics(top1=0.5, nll=2.1, tokens=100))
    assert again.resumed == 2 and "differently" in lines[0]
    with pytest.raises(Stop):  # recorded answers are gone: measured again
        again.answers("original", lambda: (_ for _ in ()).throw(Stop()))
