"""Hugging Face Hub ids (kvfold/sources/hub.py), offline: a real cache layout built in the test (blobs, refs,
snapshots of symlinks, as huggingface_hub writes it), read with HF_HUB_OFFLINE=1 through the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvfold.calib.artifact import CalibStats
from kvfold.checkpoint.manifest import Manifest
from kvfold.sources.models import resolve_model, weights_sha256
from tests.test_cli import assert_user_error, run

LLAMA = "LlamaForCausalLM"
REPO = "kvfold-test/Tiny-Llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(hub: Path, repo_id: str, folder: Path, commit: str = COMMIT, ref: str = "main",
              skip: tuple[str, ...] = ()) -> Path:
    """`folder`'s files as huggingface_hub caches repo `repo_id` at `commit` under `hub` (HF_HUB_CACHE): content
    in blobs/ named by hash, snapshots/<commit>/ of relative symlinks into it, refs/<ref> holding the commit."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in sorted(folder.iterdir()):
        if f.is_file() and f.name not in skip:
            data = f.read_bytes()
            blob = hashlib.sha256(data).hexdigest()
            (repo / "blobs" / blob).write_bytes(data)
            (snap / f.name).symlink_to(Path("../../blobs") / blob)
    (repo / "refs" / ref).write_text(commit)
    return snap


def offline(monkeypatch, home: Path) -> Path:
    """HF_HOME=home, HF_HUB_OFFLINE=1, for this process too: huggingface_hub read both at import, so its constants
    are set as a process started now would read them. Returns the hub cache folder."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return home / "hub"


@pytest.fixture
def hub(tiny_dirs, tmp_path, monkeypatch) -> Path:
    """The tiny Llama in an offline Hugging Face cache under REPO; its snapshot folder."""
    return hub_cache(offline(monkeypatch, tmp_path / "hf"), REPO, tiny_dirs[LLAMA])


def test_a_hub_id_calibrates_exports_and_verifies_offline(hub, tiny_dirs, tmp_path, monkeypatch):
    text = tmp_path / "eval.txt"
    text.write_text("\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(60)))
    calib, out = tmp_path / "calib", tmp_path / "out"
    result = run("calibrate", REPO, "-o", calib, "--tokens", 256, "--seq-len", 32)
    assert result.exit_code == 0, result.output
    local = tmp_path / "calib-local"
    assert run("calibrate", tiny_dirs[LLAMA], "-o", local, "--tokens", 256, "--seq-len", 32).exit_code == 0
    header = CalibStats.load(calib).header
    assert header.model.spec == REPO and header.model.path == str(hub.resolve())
    assert header.model.weights_sha256 == weights_sha256(tiny_dirs[LLAMA])  # the same weights as the folder's
    assert header.stats_sha256 == CalibStats.load(local).header.stats_sha256  # and the same statistics

    result = run("export", REPO, "--calib", calib, "--eval-text", text, "--eval-tokens", 256, "--ratio", 0.3,
                 "--multiple", 1, "--min-rank", 4, "-o", out)
    assert result.exit_code == 0, result.output
    source = Manifest.load(out).source
    assert (source.spec, source.hub_id, source.revision) == (REPO, REPO, COMMIT)
    saved = json.loads((out / "kvfold.json").read_text())["source"]
    assert saved["hub_id"] == REPO and saved["revision"] == COMMIT

    def verify(*extra):
        done = run("verify", out, "--eval-text", text, "--eval-tokens", 256, "--passkey", 0, "--new-tokens", 4,
                   "--json", *extra)
        assert done.exit_code == 0, done.output
        return json.loads(done.stdout)

    assert verify()["ok"] and verify("--against", f"{REPO}@{COMMIT}")["ok"]
    # The recorded folder gone (another HF_HOME): verify fetches the recorded id at the recorded commit from there.
    moved = tmp_path / "hf2"
    shutil.move(tmp_path / "hf", moved)
    offline(monkeypatch, moved)
    report = verify()
    assert report["ok"] and report["against"] == str(moved / "hub" / ("models--" + REPO.replace("/", "--"))
                                                     / "snapshots" / COMMIT)


def test_revisions_and_a_local_folder_of_that_name(hub, tiny_dirs, tmp_path, monkeypatch):
    repo = hub.parents[1]
    (repo / "refs" / "v1").write_text(COMMIT)
    assert resolve_model(f"{REPO}@v1").path == resolve_model(f"{REPO}@{COMMIT}").path == hub
    assert resolve_model(REPO).hub.revision == COMMIT
    assert_user_error(run("calibrate", f"{REPO}@v2", "-o", tmp_path / "c"),
                      f"model '{REPO}@v2' is no local folder and is not in the Hugging Face cache (HF_HUB_OFFLINE=1)")
    # a folder that exists is a folder, whatever its name looks like
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_dirs[LLAMA], tmp_path / REPO)
    ref = resolve_model(REPO)
    assert ref.hub is None and ref.path == Path(REPO)
    assert resolve_model(f"./{REPO}").hub is None


def test_pickle_weights_alone_are_refused(tiny_dirs, tmp_path, monkeypatch):
    cache = offline(monkeypatch, tmp_path / "hf")
    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_dirs[LLAMA], pickled, ignore=shutil.ignore_patterns("*.safetensors"))
    (pickled / "pytorch_model.bin").write_bytes(b"pickle")
    hub_cache(cache, "org/pickled", pickled)
    assert_user_error(run("calibrate", "org/pickled", "-o", tmp_path / "c"),
                      "the Hugging Face cache holds 'org/pickled' without its safetensors weights", tmp_path / "c")


def test_a_missing_id_is_one_line_and_exit_2_in_a_fresh_process(tmp_path):
    """The environment as a user sets it, read by a process started with it: HF_HOME's empty cache, offline."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run([sys.executable, "-m", "kvfold", "calibrate", "nobody/nothing", "-o", tmp_path / "c"],
                          env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0] == ("error: model 'nobody/nothing' is no local folder and is not in the Hugging Face cache "
                        "(HF_HUB_OFFLINE=1): run `hf download nobody/nothing` with network, or unset HF_HUB_OFFLINE")
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
def test_smollm2_under_its_hub_id(tmp_path, monkeypatch):
    """The real SmolLM2 folder (scripts/setup.sh) cached under its Hub id: calibrate, export, verify offline."""
    folder = resolve_model("smollm2").path
    hub_cache(offline(monkeypatch, tmp_path / "hf"), "HuggingFaceTB/SmolLM2-135M-Instruct", folder)
    model, calib, out = "HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path / "calib", tmp_path / "out"
    result = run("calibrate", model, "-o", calib, "--tokens", 2048, "--text", "wiki:calib")
    assert result.exit_code == 0, result.output
    # one 512-token window scored by export and verify: the Hub path is tested here, not the figures
    result = run("export", model, "--calib", calib, "--ratio", 0.3, "--eval-tokens", 512, "-o", out)
    assert result.exit_code == 0, result.output
    assert Manifest.load(out).source.hub_id == model
    done = run("verify", out, "--eval-text", "wiki:eval", "--eval-tokens", 512, "--passkey", 0, "--json")
    assert done.exit_code in (0, 1), done.output  # 1: a 0.3 export may miss a check; the run itself must work
    assert json.loads(done.stdout)["against"].endswith(f"snapshots/{COMMIT}")


@pytest.mark.parametrize(("error", "offline_mode", "said"), [
    ("GatedRepoError", False, "is gated on the Hugging Face Hub: accept its terms"),
    ("RevisionNotFoundError", False, "the Hugging Face Hub has no revision 'v9'"),
    ("RepositoryNotFoundError", False, "is no local folder and no model on the Hugging Face Hub"),
    ("LocalEntryNotFoundError", False, "the Hub cannot be reached: run `hf download org/model --revision v9` where"),
    ("IncompleteSnapshotError", True, "holds part of 'org/model@v9' only"),
])
def test_the_hubs_answers_are_one_line_each(tmp_path, monkeypatch, error, offline_mode, said):
    """What the Hub answers online (faked: no network here), each as one line naming the fix."""
    import huggingface_hub
    from huggingface_hub import errors

    offline(monkeypatch, tmp_path / "hf")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline_mode)
    exc = getattr(errors, error)

    def answer(*args, **kwargs):
        raise exc.__new__(exc)  # its __init__ wants a real HTTP response

    monkeypatch.setattr(huggingface_hub, "snapshot_download", answer)
    assert_user_error(run("calibrate", "org/model@v9", "-o", tmp_path / "c"), said, tmp_path / "c")


def test_a_repository_with_pickle_weights_only_is_refused_online(tiny_dirs, tmp_path, monkeypatch):
    import huggingface_hub

    cache = offline(monkeypatch, tmp_path / "hf")
    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_dirs[LLAMA], pickled, ignore=shutil.ignore_patterns("*.safetensors"))
    snap = hub_cache(cache, "org/pickled", pickled)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: str(snap))  # the Hub had no more
    assert_user_error(run("calibrate", "org/pickled", "-o", tmp_path / "c"),
                      "'org/pickled' has no safetensors weights (model.safetensors or its index); kvfold does not "
                      "load pickle (*.bin) weights", tmp_path / "c")
