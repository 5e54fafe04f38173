"""Passkey retrieval: can the model still find a number it read thousands of tokens ago?

KV compression matters at long context, where scored 512-token windows say little. Each prompt is about
`context` tokens: the standard passkey task (Mohtashami & Jaggi 2023, as LongLoRA and others run it) — a
repeated filler paragraph with one sentence naming a five-digit pass key hidden at a given depth (a
fraction of the way in), then the question. Real text as the filler is harder than a 135M model can do:
measured 2026-11-24, SmolLM2-135M-Instruct retrieves 0 of 10 keys hidden in wiki:eval text at 1,024
tokens (0 of 3 with its chat template), and 3 of 3 in the standard filler at 4,096 — a check the original
fails tells nothing about the export.

The model retrieves the key when its greedy answer is the key's tokens. Greedy decoding writes the answer
iff at every answer position the argmax, given the prompt and the answer so far, is the answer's next
token — so one forward pass over prompt + answer scores a prompt exactly as generation would, with or
without a cache, and works for the frontier's patched attention as for a served export.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from kvfold.errors import KVFoldError
from kvfold.progress import progress

__all__ = ["DEPTHS", "Answers", "PasskeyPrompt", "passkey_answers", "passkey_hits", "passkey_length", "passkey_prompts",
           "passkey_summary"]

INTRO = "There is important info hidden inside a lot of irrelevant text. Find it and memorize it."
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key? The pass key is"
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # where the needle sits, as a fraction of the filler


@dataclass(frozen=True)
class PasskeyPrompt:
    ids: torch.Tensor  # [T] int64: filler with the needle, the question, then the answer
    answer: int  # the answer's token count; they are the last `answer` ids
    depth: float
    key: int


def passkey_prompts(tokenizer, context: int, depths: tuple[float, ...] = DEPTHS, per_depth: int = 2,
                    seed: int = 0) -> list[PasskeyPrompt]:
    """len(depths) × per_depth prompts of about `context` tokens (within one filler paragraph), seeded keys."""
    rng = np.random.default_rng(seed)

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    question, filler, intro = ids(QUESTION), ids(FILLER), ids(INTRO)
    prompts = []
    for depth in (d for d in depths for _ in range(per_depth)):
        key = int(rng.integers(10000, 100000))
        needle, with_answer = ids(NEEDLE.format(key=key)), ids(QUESTION + f" {key}")
        if with_answer[:len(question)] != question:
            raise AssertionError("the tokenizer splits the question differently before an answer")
        repeats = (context - len(intro) - len(needle) - len(with_answer)) // len(filler)
        if repeats < 2:
            raise KVFoldError(f"--passkey {context} leaves no room for text around the key; give at least 256")
        before = round(depth * repeats)
        prompt = intro + filler * before + needle + filler * (repeats - before) + with_answer
        prompts.append(PasskeyPrompt(ids=torch.tensor(prompt, dtype=torch.long),
                                     answer=len(with_answer) - len(question), depth=depth, key=key))
    return prompts


def passkey_length(model: nn.Module, context: int) -> int:
    """The prompt length export's check and verify use: `context`, or the model's whole context if shorter."""
    return min(context, getattr(model.config.get_text_config(), "max_position_embeddings", None) or context)


class Answers(NamedTuple):
    """Per prompt, from one teacher-forced forward pass over prompt + answer."""
    hits: list[bool]  # greedy decoding writes the key
    nlls: list[float]  # the answer's mean NLL per token, nats
    margins: list[float]  # the smallest, over the answer's tokens, of its logit minus the best other token's:
    # > 0 iff the key is retrieved; how far a key is from flipping (rounding alone moves it by ~0.2, plan/longrange.py)


def passkey_answers(model: nn.Module, prompts: list[PasskeyPrompt], description: str = "pass keys") -> Answers:
    """Per prompt: whether greedy decoding after its question writes its key, the answer's mean NLL and its
    logit margin (Answers). The count sits at a small model's noise floor — SmolLM2's answers win by 0.26–1.4
    nats — so the NLL and the margin are what tell two nearby caches apart. Its progress is a stage named
    `description` (kvfold/progress.py)."""
    out = Answers([], [], [])
    with torch.inference_mode(), progress(description, len(prompts), "prompts") as advance:
        for p in prompts:
            ids = p.ids[None].to(model.device)
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=p.answer + 1).logits[0, :-1].float().cpu()
            answer = p.ids[-p.answer:]
            right = logits.gather(1, answer[:, None])[:, 0]
            others = logits.scatter(1, answer[:, None], float("-inf")).amax(-1)
            out.hits.append(bool(torch.equal(logits.argmax(-1), answer)))
            out.nlls.append(float(torch.nn.functional.cross_entropy(logits, answer)))
            out.margins.append(float((right - others).min()))
            advance()
    return out


def passkey_hits(model: nn.Module, prompts: list[PasskeyPrompt]) -> list[bool]:
    """Whether greedy decoding after each prompt's question writes its key (one forward pass each, the
    logits only at the answer's positions)."""
    return passkey_answers(model, prompts)[0]


def passkey_summary(prompts: list[PasskeyPrompt], hits: list[bool], nlls: list[float] | None = None,
                    against: list[float] | None = None, margins: list[float] | None = None) -> dict:
    """Retrieved keys in all and per depth, for reports; with `nlls` the answers' mean NLL ± its standard error
    over the prompts, and with `against` (the original's NLLs on the same prompts) the paired difference
    ± its standard error: > 0 means the answers lost probability; with `margins` (Answers) the smallest."""
    depths = sorted({p.depth for p in prompts})
    extra = {}
    if nlls:
        extra = {"answer_nll": _mean_se(nlls)}
        if against:
            extra["answer_nll_change"] = _mean_se([a - b for a, b in zip(nlls, against, strict=True)])
    if margins:
        extra["smallest_margin"] = round(min(margins), 4)
    return {"context": len(prompts[0].ids) if prompts else 0, "prompts": len(prompts), "retrieved": sum(hits),
            "by_depth": {f"{d:g}": sum(h for p, h in zip(prompts, hits, strict=True) if p.depth == d)
                         for d in depths}, **extra}


def _mean_se(xs: list[float]) -> dict:
    n = len(xs)
    mean = sum(xs) / n
    se = (sum((x - mean) ** 2 for x in xs) / (n - 1) / n) ** 0.5 if n > 1 else float("nan")
    return {"mean": round(mean, 4), "se": round(se, 4)}
