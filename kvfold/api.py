"""The functions behind each CLI command. Tests call these; the CLI only parses and prints."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

import kvfold
from kvfold.adapters import HeadLayout
from kvfold.calib.artifact import CalibHeader, CalibOptions, CalibStats, ModelIdentity
from kvfold.calib.inspect import LayerSpectrum, spectrum_table
from kvfold.calib.run import collect
from kvfold.calib.sinks import GramSink, KMeansSink
from kvfold.calib.tokens import batches, prune, random_sequences, text_sequences
from kvfold.errors import KVFoldError
from kvfold.export import ExportResult, export
from kvfold.io import atomic_dir
from kvfold.plan.recipe import Recipe, RecipeOverrides, load_recipe
from kvfold.progress import progress
from kvfold.sources.models import (
    DTYPES,
    check_device_map,
    load_model,
    resolve_device,
    resolve_model,
    run_dtype,
    weights_sha256,
)
from kvfold.sources.text import resolve_text
from kvfold.sources.tokenizer import load_tokenizer
from kvfold.verify import DEFAULT_TEXTS, VerifyReport, verify

__all__ = ["DEFAULT_TEXTS", "CalibResult", "ExportResult", "Recipe", "RecipeOverrides", "VerifyReport", "calibrate",
           "export", "inspect", "load_recipe", "perplexity", "prepare", "verify"]


@dataclass(frozen=True)
class CalibResult:
    header: CalibHeader
    output: Path
    seconds_load: float
    seconds_collect: float


def prepare(model: str) -> Path:
    """Resolve a model argument (building an embedded default's cache if needed); return its folder."""
    return resolve_model(model).path


def perplexity(model: str, texts: list[str], tokens: int, dtype: str | None = None,
               seq_len: int = 512) -> dict[str, tuple[float, float]]:
    """The model's own perplexity and next-token top-1 accuracy on `tokens` of each text, in `seq_len`-token
    windows (the export search's), in `dtype` (default: sources.models.run_dtype's rule): a sanity check of a
    converted model."""
    from kvfold.measure.evaluate import score_model

    ref = resolve_model(model)
    tokenizer = load_tokenizer(ref.path)
    net = load_model(ref, run_dtype(ref, dtype or "auto"))
    out = {}
    for text in texts:
        metrics = score_model(net, text_sequences(tokenizer, resolve_text(text), tokens, seq_len, seed=0), batch=4)
        out[text] = (math.exp(metrics.nll), metrics.top1)
    return out


def calibrate(
    model: str,
    output: Path,
    *,
    source: str | None = None,
    text: str | None = None,
    tokens: int = 16384,
    seq_len: int = 512,
    batch: int = 8,
    prune_fraction: float = 0.0,
    kmeans: int | None = None,
    seed: int = 0,
    dtype: str = "auto",
    device: str = "auto",
    device_map: str | None = None,
    force: bool = False,
) -> CalibResult:
    """Measure per-head attention statistics of `model` and write them to `output` atomically (its batches'
    progress: kvfold/progress.py)."""
    source = source or ("text" if text else "random")
    checked = dict(
        source=_check_choice("--source", source, ("random", "text")),
        text=_text_spec(source, text),
        tokens=_check_positive("--tokens", tokens),
        seq_len=_check_positive("--seq-len", seq_len),
        batch=_check_positive("--batch", batch),
        prune=_check_fraction("--prune", prune_fraction),
        kmeans=None if kmeans is None else _check_positive("--kmeans", kmeans),
        seed=seed,
    )
    _check_choice("--dtype", dtype, ("auto", *DTYPES))
    check_device_map(device_map)
    output = Path(output)
    ref = resolve_model(model)
    device = resolve_device(device)
    options = CalibOptions(**checked, dtype=run_dtype(ref, dtype, device))
    docs = resolve_text(options.text) if options.text else None

    with atomic_dir(output, force=force) as tmp:
        t0 = time.perf_counter()
        net = load_model(ref, options.dtype, device, device_map)
        layout = HeadLayout.from_config(net.config)
        identity = ModelIdentity(
            spec=model, path=str(ref.path.resolve()), architecture=ref.architecture,
            adapter=ref.adapter.name, weights_sha256=weights_sha256(ref.path), **vars(layout),
        )
        seqs = _sequences(ref.path, net, docs, options)
        sink = _sink(options, seqs)
        t1 = time.perf_counter()
        with progress("calibrating", seqs.num_tokens * sink.passes, "tokens") as advance:
            grams = collect(net, ref.adapter, seqs, options.batch, sink, on_batch=advance)
        t2 = time.perf_counter()
        header = CalibHeader(
            kvfold_version=kvfold.__version__, torch_version=torch.__version__,
            transformers_version=transformers.__version__, model=identity, options=options,
            tokens=seqs.num_tokens, sequences=len(seqs.ids),
        )
        CalibStats(header=header, grams=grams).save(tmp)
    saved = CalibStats.load(output).header
    return CalibResult(header=saved, output=output, seconds_load=t1 - t0, seconds_collect=t2 - t1)


def inspect(calib_dir: Path) -> tuple[CalibHeader, list[LayerSpectrum]]:
    stats = CalibStats.load(Path(calib_dir))
    return stats.header, spectrum_table(stats)


def _sequences(path: Path, net, docs: list[str] | None, options: CalibOptions):
    if options.source == "random":
        seqs = random_sequences(net.config.vocab_size, options.tokens, options.seq_len, options.seed)
    else:
        tokenizer = load_tokenizer(path, " or use --source random")
        seqs = text_sequences(tokenizer, docs, options.tokens, options.seq_len, options.seed)
    return prune(seqs, options.prune, options.seed)


def _sink(options: CalibOptions, seqs):
    if options.kmeans is None:
        return GramSink()
    smallest = min(b.numel() for b in batches(seqs, options.batch))
    if options.kmeans > smallest:
        raise KVFoldError(f"--kmeans {options.kmeans} exceeds the {smallest} tokens of the smallest batch; "
                          "lower --kmeans or raise --batch/--seq-len")
    return KMeansSink(options.kmeans, options.seed)


def _text_spec(source: str, text: str | None) -> str | None:
    if source == "random":
        if text:
            raise KVFoldError("--text is only used with --source text; drop --text or add --source text")
        return None
    return text or "wiki:calib"


def _check_positive(flag: str, value: int) -> int:
    if value < 1:
        raise KVFoldError(f"{flag} must be at least 1, got {value}")
    return value


def _check_fraction(flag: str, value: float) -> float:
    if not 0.0 <= value < 1.0:
        raise KVFoldError(f"{flag} must be in [0, 1), got {value}")
    return value


def _check_choice(flag: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise KVFoldError(f"{flag} must be one of {', '.join(choices)}, got '{value}'")
    return value
