"""The functions behind each CLI command. Tests call these; the CLI only parses and prints."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
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
from kvfold.checkpoint.manifest import Calibration, Manifest, Point, SourceModel
from kvfold.checkpoint.writer import write_checkpoint
from kvfold.errors import KVFoldError
from kvfold.io import atomic_dir
from kvfold.plan.evaluate import METRICS, Evaluator
from kvfold.plan.ranks import RankRule, plan_ranks
from kvfold.plan.targets import for_accuracy, for_compression
from kvfold.rewrite.bake import K_POST, Q_POST, bake
from kvfold.rewrite.factors import get_method
from kvfold.rewrite.weights import o_proj_heads
from kvfold.sources.models import DTYPES, load_model, resolve_model, weights_sha256
from kvfold.sources.text import resolve_text

__all__ = ["CalibResult", "ExportResult", "calibrate", "export", "inspect", "prepare"]


@dataclass(frozen=True)
class CalibResult:
    header: CalibHeader
    output: Path
    seconds_load: float
    seconds_collect: float


def prepare(model: str) -> Path:
    """Resolve a model argument (building an embedded default's cache if needed); return its folder."""
    return resolve_model(model).path


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
    dtype: str = "float32",
    force: bool = False,
    progress=None,
) -> CalibResult:
    """Measure per-head attention statistics of `model` and write them to `output` atomically.

    `progress(total_tokens)` may return a callable advanced by the tokens of each batch."""
    source = source or ("text" if text else "random")
    options = CalibOptions(
        source=_check_choice("--source", source, ("random", "text")),
        text=_text_spec(source, text),
        tokens=_check_positive("--tokens", tokens),
        seq_len=_check_positive("--seq-len", seq_len),
        batch=_check_positive("--batch", batch),
        prune=_check_fraction("--prune", prune_fraction),
        kmeans=None if kmeans is None else _check_positive("--kmeans", kmeans),
        seed=seed,
        dtype=_check_choice("--dtype", dtype, tuple(DTYPES)),
    )
    output = Path(output)
    ref = resolve_model(model)
    docs = resolve_text(options.text) if options.text else None

    with atomic_dir(output, force=force) as tmp:
        t0 = time.perf_counter()
        net = load_model(ref, dtype)
        layout = HeadLayout.from_config(net.config)
        identity = ModelIdentity(
            spec=model, path=str(ref.path.resolve()), architecture=ref.architecture,
            adapter=ref.adapter.name, weights_sha256=weights_sha256(ref.path), **vars(layout),
        )
        seqs = _sequences(ref.path, net, docs, options)
        sink = _sink(options, seqs)
        t1 = time.perf_counter()
        advance = progress(seqs.num_tokens * sink.passes) if progress else None
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


@dataclass(frozen=True)
class ExportResult:
    manifest: Manifest
    output: Path


def export(
    model: str,
    calib: Path,
    output: Path,
    *,
    accuracy: float | None = None,
    ratio: float | None = None,
    method: str = "aware",
    eval_text: str = "wiki:dev",
    eval_tokens: int = 8192,
    metric: str = "top1",
    multiple: int = 8,
    min_rank: int = 8,
    force: bool = False,
) -> ExportResult:
    """Choose per-head ranks for an accuracy (or compression) target, bake them, write a checkpoint."""
    if (accuracy is None) == (ratio is None):
        raise KVFoldError("give exactly one of --accuracy A or --ratio P")
    if accuracy is not None and not 0.0 < accuracy <= 1.0:
        raise KVFoldError(f"--accuracy must be in (0, 1], got {accuracy}")
    if ratio is not None and not 0.0 <= ratio < 1.0:
        raise KVFoldError(f"--ratio must be in [0, 1), got {ratio}")
    _check_choice("--metric", metric, METRICS)
    _check_positive("--eval-tokens", eval_tokens)
    _check_positive("--multiple", multiple)
    factor_method = get_method(method)
    ref = resolve_model(model)
    stats = CalibStats.load(Path(calib))
    sha = weights_sha256(ref.path)
    if stats.header.model.weights_sha256 != sha:
        raise KVFoldError(f"'{calib}' was calibrated on different weights than '{model}' (sha256 differs); "
                          f"run kvfold calibrate {model} first")
    docs = resolve_text(eval_text)
    rule = partial(RankRule, multiple=multiple, min_rank=min_rank)

    with atomic_dir(Path(output), force=force) as tmp:
        net = load_model(ref)
        bases = [factor_method.basis(stats, i, o_proj_heads(net, ref.adapter, i))
                 for i in range(stats.header.model.num_layers)]
        windows = text_sequences(_tokenizer(ref.path), docs, eval_tokens, 512, seed=0)
        evaluator = Evaluator(net, ref.adapter, windows)

        def shared(r: float) -> RankRule:
            return rule(r_k=r, r_v=r)

        if accuracy is not None:
            best, curve = for_accuracy(bases, evaluator, accuracy, metric, shared)
        else:
            best, curve = for_compression(bases, evaluator, ratio, shared)
        ranks = plan_ranks(bases, shared(best.r_k))
        factors = [b.truncate(dk, dv) for b, dk, dv in zip(bases, ranks.d_k, ranks.d_v, strict=True)]
        baked = bake(net, ref.adapter, factors)
        h = stats.header
        manifest = Manifest(
            kvfold_version=kvfold.__version__, torch_version=torch.__version__,
            transformers_version=transformers.__version__,
            source=SourceModel(spec=model, path=str(ref.path.resolve()), architecture=ref.architecture,
                               weights_sha256=sha),
            calibration=Calibration(source=h.options.source, text=h.options.text, tokens=h.tokens,
                                    seed=h.options.seed, stats_sha256=h.stats_sha256),
            method=method, metric=metric,
            target=f"{metric}>={accuracy}" if accuracy is not None else f"compression>={ratio}",
            eval_text=eval_text, eval_tokens=evaluator.baseline.tokens,
            baseline_top1=evaluator.baseline.top1, baseline_ppl=evaluator.baseline.ppl,
            rounding_multiple=multiple, min_rank=min_rank, head_dim=h.model.head_dim,
            num_heads=h.model.num_heads, num_kv_heads=h.model.num_kv_heads, d_k=ranks.d_k, d_v=ranks.d_v,
            chosen=Point(**vars(best)), curve=[Point(**vars(p)) for p in curve],
            extra_tensors=_extra_tensor_names(baked, ref.adapter),
        )
        manifest = write_checkpoint(baked, ref.path, manifest, tmp)
    return ExportResult(manifest=manifest, output=Path(output))


def _extra_tensor_names(baked, adapter) -> list[str]:
    if not adapter.rope:
        return []
    return sorted(n for n, _ in baked.named_parameters() if n.endswith((Q_POST, K_POST)))


def _tokenizer(path: Path, alternative: str = ""):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        raise KVFoldError(f"'{path}' has no usable tokenizer, which reading text needs; "
                          f"save one beside the model{alternative}") from None


def inspect(calib_dir: Path) -> tuple[CalibHeader, list[LayerSpectrum]]:
    stats = CalibStats.load(Path(calib_dir))
    return stats.header, spectrum_table(stats)


def _sequences(path: Path, net, docs: list[str] | None, options: CalibOptions):
    if options.source == "random":
        seqs = random_sequences(net.config.vocab_size, options.tokens, options.seq_len, options.seed)
    else:
        tokenizer = _tokenizer(path, " or use --source random")
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
