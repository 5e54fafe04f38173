"""Shared fixtures: tiny seeded random models of every adapter, built once per test run."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Qwen2Config,
    Qwen3Config,
)

VOCAB = 260  # 256 byte tokens + specials of the tiny byte-level tokenizer
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256)

# architecture -> config factory. One row per adapter in kvfold.adapters.ADAPTERS.
TINY_CONFIGS = {
    "LlamaForCausalLM": lambda: LlamaConfig(**_COMMON),
    "MistralForCausalLM": lambda: MistralConfig(**_COMMON, sliding_window=16),
    "Qwen2ForCausalLM": lambda: Qwen2Config(**_COMMON),
    "Qwen3ForCausalLM": lambda: Qwen3Config(**_COMMON, head_dim=16),
    "Gemma2ForCausalLM": lambda: Gemma2Config(**_COMMON, head_dim=16, sliding_window=16),
    "Gemma3ForCausalLM": lambda: Gemma3TextConfig(**_COMMON, head_dim=16, sliding_window=16),
    "GPT2LMHeadModel": lambda: GPT2Config(vocab_size=VOCAB, n_embd=64, n_head=4, n_layer=2, n_positions=256),
    "OPTForCausalLM": lambda: OPTConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, ffn_dim=128,
                                        num_hidden_layers=2, max_position_embeddings=256,
                                        word_embed_proj_dim=64),
}
ROPE_ARCHS = [a for a in TINY_CONFIGS if not a.startswith(("GPT2", "OPT"))]


def build_tiny(arch: str, **overrides):
    """The tiny seeded model of `arch`; `overrides`: config fields to change (e.g. more heads)."""
    torch.manual_seed(0)
    config = TINY_CONFIGS[arch]()
    for name, value in overrides.items():
        setattr(config, name, value)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # HF's default init (std 0.02) gives near-uniform attention; a wider spread makes spectra and
    # attention patterns non-trivial, so the tests can tell right from wrong.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    assert model.config.architectures == [arch] or type(model).__name__ == arch
    return model


@contextmanager
def module_dir(tmp_path_factory, name: str) -> Iterator[Path]:
    """A fresh directory for a module-scoped fixture, removed when the fixture is torn down (the module's end):
    pytest keeps fixtures' directories to the session's end, and a real model's export is GBs."""
    root = tmp_path_factory.mktemp(name)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def tiny_tokenizer():
    """A byte-level tokenizer with no merges: every byte is a token; EOS is id 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["</s>"] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def save_tiny(folder: Path, arch: str, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """`build_tiny(arch, **overrides)` in `dtype`, saved with the tiny tokenizer as a HF model folder."""
    model = build_tiny(arch, **overrides).to(dtype)
    model.config.architectures = [arch]
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def write_tiny_text(path: Path) -> Path:
    """A small evaluation text the tiny tokenizer reads byte by byte: 60 short paragraphs."""
    path.write_text("\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(60)))
    return path


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict:
    """architecture -> a saved HF folder of the tiny model (for API and CLI tests)."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: save_tiny(root / arch, arch) for arch in TINY_CONFIGS}


def rerun_in_triton_interpreter(test_file: str, *args: str) -> str:
    """Run `test_file`'s tests (selected by pytest `args`) in a child pytest with TRITON_INTERPRET=1 — Triton reads
    it once, at its first import — and return the child's output; fails the caller's test if the child fails."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    # tests/interpreter_speedup.py: the interpreter without its redundant re-patching of triton.language
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.interpreter_speedup",
           str(Path(test_file).relative_to(root)), *args]
    run = subprocess.run(cmd, cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    # A child whose every test skipped (or that selected none) exits 0 too: the kernels did not run, so fail.
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert " passed" in summary and "skipped" not in summary, f"not every selected child test ran: {summary!r}"
    return run.stdout


# ---- SmolLM2-135M, real weights: what several slow modules share --------------------------------------------------
# One text calibration and one full-rank export serve test_smollm2.py and the vLLM tests alike: on CI's 2 cores a
# calibration of 8,192 tokens takes ~35 s and an export ~40 s, and each module used to make its own.
SMOLLM2_CALIB_TOKENS = 8192


@pytest.fixture(scope="session")
def smollm2_calib(tmp_path_factory) -> Path:
    """SmolLM2 calibrated on wiki:calib, 8,192 tokens in 512-token windows (the demo's source, a quarter of its
    default count)."""
    from kvfold import api

    out = tmp_path_factory.mktemp("smollm2-calib") / "calib"
    api.calibrate("smollm2", out, text="wiki:calib", tokens=SMOLLM2_CALIB_TOKENS)
    return out


@pytest.fixture(scope="session")
def smollm2_full_export(smollm2_calib, tmp_path_factory) -> Path:
    """A full-rank export of SmolLM2 (p = 0, every width 64: the rotations folded into the weights, nothing cut),
    scored on one 512-token window."""
    from kvfold import api
    from kvfold.plan.recipe import Recipe

    out = tmp_path_factory.mktemp("smollm2-full") / "export"
    api.export("smollm2", smollm2_calib, out, Recipe(ratio=0.0, multiple=1, min_rank=64, eval_tokens=512))
    return out
