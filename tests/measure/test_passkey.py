"""Passkey prompts (measure/passkey.py): their layout, and one forward pass scoring them as greedy decoding would."""

import pytest
import torch

from kvfold.errors import KVFoldError
from kvfold.measure.passkey import (
    DEPTHS,
    FILLER,
    PasskeyPrompt,
    passkey_answers,
    passkey_hits,
    passkey_prompts,
    passkey_summary,
)
from tests.conftest import build_tiny, tiny_tokenizer


def test_prompts_hide_a_seeded_key_at_each_depth_and_end_with_its_answer():
    tok = tiny_tokenizer()  # one token per byte: lengths and positions are exact
    prompts = passkey_prompts(tok, 2048)
    assert [p.depth for p in prompts] == [d for d in DEPTHS for _ in range(2)]
    assert [p.key for p in prompts] == [p.key for p in passkey_prompts(tok, 2048)]  # seeded
    assert len({p.key for p in prompts}) == len(prompts)
    for p in prompts:
        text = tok.decode(p.ids)
        assert 2048 - len(FILLER) < len(p.ids) <= 2048
        assert text.endswith(f"The pass key is {p.key}") and p.answer == len(f" {p.key}")
        assert text.count(str(p.key)) == 3  # twice in the needle, once as the answer
        where = text.index(f"The pass key is {p.key}.") / len(text)
        assert abs(where - p.depth) < 0.06
    with pytest.raises(KVFoldError, match="give at least 256"):
        passkey_prompts(tok, 200)


def test_one_forward_pass_scores_a_prompt_as_greedy_decoding_would():
    model = build_tiny("LlamaForCausalLM")
    prompt = passkey_prompts(tiny_tokenizer(), 512)[0]
    question = prompt.ids[:-prompt.answer]
    with torch.inference_mode():
        greedy = model.generate(question[None], max_new_tokens=prompt.answer, do_sample=False,
                                min_new_tokens=prompt.answer)[0, len(question):]
    # the answer the model writes is retrieved; change any one of its tokens and it is not
    right = PasskeyPrompt(torch.cat([question, greedy]), prompt.answer, prompt.depth, prompt.key)
    wrong = [PasskeyPrompt(torch.cat([question, greedy.clone().index_fill_(0, torch.tensor([i]),
                                                                              (int(greedy[i]) + 1) % 256)]),
                           prompt.answer, prompt.depth, prompt.key) for i in range(prompt.answer)]
    assert passkey_hits(model, [right, *wrong]) == [True] + [False] * prompt.answer
    margins = passkey_answers(model, [right, *wrong]).margins  # > 0 exactly where the key is written
    assert margins[0] > 0 and all(m < 0 for m in margins[1:])
    summary = passkey_summary([right, *wrong], [True] + [False] * prompt.answer)
    assert summary["retrieved"] == 1 and summary["by_depth"] == {f"{prompt.depth:g}": 1}


def test_the_answers_nll_is_the_mean_cross_entropy_of_its_tokens_and_compares_by_prompt():
    model = build_tiny("LlamaForCausalLM")
    prompts = passkey_prompts(tiny_tokenizer(), 512)[:3]
    hits, nlls, margins = passkey_answers(model, prompts)
    assert hits == passkey_hits(model, prompts)
    with torch.inference_mode():
        for p, nll, margin in zip(prompts, nlls, margins, strict=True):
            logits = model(input_ids=p.ids[None]).logits[0, -p.answer - 1 : -1]  # the full pass, every position
            want = -logits.log_softmax(-1).gather(-1, p.ids[-p.answer:, None]).mean()
            assert nll == pytest.approx(float(want), rel=1e-5)
            # the margin: the answer's logit over the best other token's, at its closest position
            ranked = logits.topk(2, -1).values
            right = logits.gather(-1, p.ids[-p.answer:, None])[:, 0]
            other = torch.where(ranked[:, 0] == right, ranked[:, 1], ranked[:, 0])
            assert margin == pytest.approx(float((right - other).min()), abs=1e-4)
    worse = [x + 0.5 * i for i, x in enumerate(nlls)]
    summary = passkey_summary(prompts, hits, worse, against=nlls)
    mean = sum(worse) / 3
    assert summary["answer_nll"]["mean"] == pytest.approx(mean, abs=1e-4)
    assert summary["answer_nll_change"] == {"mean": 0.5, "se": pytest.approx(0.5 / 3**0.5, abs=1e-4)}  # 0, .5, 1
    assert "answer_nll" not in passkey_summary(prompts, hits)
    assert passkey_summary(prompts, hits, nlls, margins=margins)["smallest_margin"] == pytest.approx(min(margins),
                                                                                                   abs=1e-4)
