"""Hugging Face Hub ids (`org/name[@revision]`): the snapshot folder in the Hugging Face cache, downloaded through
huggingface_hub where it is missing (HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE as huggingface_hub reads them).

Only what loading needs is fetched: config, tokenizer and safetensors weights (the index's shards, or
model.safetensors); a repository with pickle weights alone (*.bin) is refused, never loaded."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from kvfold.errors import KVFoldError

__all__ = ["HubModel", "is_hub_id", "snapshot"]

# Top-level files a model's config and tokenizer are read from (never code: no trust_remote_code).
METADATA = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
            "chat_template.jinja", "chat_template.json", "model.safetensors.index.json")
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_HUB_ID = re.compile(rf"(?P<repo>{_NAME}/{_NAME})(?:@(?P<revision>[A-Za-z0-9._/-]+))?")


@dataclass(frozen=True)
class HubModel:
    repo_id: str  # org/name
    revision: str  # the commit the snapshot holds (what `@main` resolved to)


def is_hub_id(spec: str) -> bool:
    """`org/name` or `org/name@revision`: a Hub id's form (a folder that exists is a folder, asked first)."""
    return _HUB_ID.fullmatch(spec) is not None and ".." not in spec


def snapshot(spec: str) -> tuple[Path, HubModel]:
    """The cached snapshot folder of hub id `spec` holding its config, tokenizer and safetensors weights, fetched
    where missing (unless offline), and the commit it is; KVFoldError, one line, when that cannot be had."""
    found = _HUB_ID.fullmatch(spec)
    assert found, spec
    repo_id, revision = found["repo"], found["revision"]
    folder = _download(spec, repo_id, revision, list(METADATA))
    index = folder / "model.safetensors.index.json"
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else []
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise KVFoldError(f"cannot read {index} of '{spec}': {e}") from None
    folder = _download(spec, repo_id, revision, shards or ["model.safetensors"])
    if not (folder / "config.json").is_file():
        raise KVFoldError(f"'{spec}' has no config.json in its snapshot {folder}: not a transformers model")
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing or not (shards or (folder / "model.safetensors").is_file()):
        if _offline():
            raise KVFoldError(f"the Hugging Face cache holds '{spec}' without its safetensors weights "
                              f"({', '.join(missing[:2]) or 'model.safetensors'}; HF_HUB_OFFLINE=1): run "
                              f"`hf download {repo_id}` with network, or unset HF_HUB_OFFLINE")
        raise KVFoldError(f"'{spec}' has no safetensors weights (model.safetensors or its index); kvfold does not "
                          "load pickle (*.bin) weights: pick a repository with safetensors, or convert it")
    return folder, HubModel(repo_id=repo_id, revision=folder.name)


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _download(spec: str, repo_id: str, revision: str | None, patterns: list[str]) -> Path:
    """snapshot_download of `patterns`, its errors as one line each."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    get = f"`hf download {repo_id}" + (f" --revision {revision}`" if revision else "`")
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except GatedRepoError:
        raise KVFoldError(f"model '{spec}' is gated on the Hugging Face Hub: accept its terms on huggingface.co, "
                          "then `hf auth login`") from None
    except RevisionNotFoundError:
        raise KVFoldError(f"model '{spec}': the Hugging Face Hub has no revision '{revision}'") from None
    except RepositoryNotFoundError:
        raise KVFoldError(f"model '{spec}' is no local folder and no model on the Hugging Face Hub (a private one "
                          "needs `hf auth login`)") from None
    except IncompleteSnapshotError:
        raise KVFoldError(f"the Hugging Face cache holds part of '{spec}' only: run {get} to complete it") from None
    except LocalEntryNotFoundError:
        if _offline():
            raise KVFoldError(f"model '{spec}' is no local folder and is not in the Hugging Face cache "
                              f"(HF_HUB_OFFLINE=1): run {get} with network, or unset HF_HUB_OFFLINE") from None
        raise KVFoldError(f"model '{spec}' is no local folder, is not in the Hugging Face cache, and the Hub "
                          f"cannot be reached: run {get} where it can") from None
    except HFValidationError as e:
        raise KVFoldError(f"model '{spec}' is no local folder and no valid Hugging Face Hub id: {_first(e)}") from None
    except (HfHubHTTPError, OSError) as e:
        raise KVFoldError(f"cannot get model '{spec}' from the Hugging Face Hub: {_first(e)}") from None


def _first(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
