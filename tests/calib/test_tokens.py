import pytest
import torch

from kvfold.calib.tokens import Sequences, batches, prune, random_sequences, text_sequences
from kvfold.errors import KVFoldError
from kvfold.sources.text import Mixture
from tests.conftest import tiny_tokenizer


def test_random_sequences_are_seeded_and_exact_in_count():
    a = random_sequences(100, 1000, 256, seed=1)
    b = random_sequences(100, 1000, 256, seed=1)
    c = random_sequences(100, 1000, 256, seed=2)
    assert a.num_tokens == 1000 and [len(s) for s in a.ids] == [256, 256, 256, 232]
    assert all(torch.equal(x, y) for x, y in zip(a.ids, b.ids, strict=True))
    assert not torch.equal(a.ids[0], c.ids[0])
    assert max(int(s.max()) for s in a.ids) < 100


def test_batches_group_equal_lengths():
    seqs = random_sequences(100, 1000, 256, seed=0)
    shapes = [tuple(b.shape) for b in batches(seqs, 2)]
    assert shapes == [(2, 256), (1, 256), (1, 232)]


def test_prune_drops_fraction_per_group_and_keeps_every_group():
    ids = [torch.zeros(4, dtype=torch.long)] * 300
    groups = [i % 3 for i in range(300)]  # three groups of 100
    kept = prune(Sequences(ids=ids, groups=groups), 0.25, seed=0)
    counts = [kept.groups.count(g) for g in range(3)]
    assert counts == [75, 75, 75]
    assert prune(Sequences(ids=ids, groups=groups), 0.0, seed=0).groups == groups


class _CharTokenizer:
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_text_sequences_pack_documents_with_eos_and_track_groups():
    docs = ["a" * 10, "b" * 10, "c" * 10]
    seqs = text_sequences(_CharTokenizer(), docs, tokens=30, seq_len=8, seed=0)
    stream = torch.cat(seqs.ids).tolist()
    assert len(stream) == 30 and stream.count(0) >= 2  # EOS between documents
    assert len(seqs.groups) == len(seqs.ids) == 4


def test_text_sequences_too_little_text():
    from kvfold.errors import KVFoldError

    with pytest.raises(KVFoldError, match="only 11 tokens"):
        text_sequences(_CharTokenizer(), ["x" * 10], tokens=100, seq_len=8, seed=0)


def test_a_mixture_takes_equal_shares_in_alternating_windows():
    tok = tiny_tokenizer()
    a = [f"alpha document {i} " * 20 for i in range(10)]
    b = [f"BETA TEXT {i} " * 30 for i in range(5)]
    mix = text_sequences(tok, Mixture(("a", "b"), (a, b)), 5 * 64 + 10, 64, seed=0)
    assert mix.num_tokens == 5 * 64 + 10 and [len(s) for s in mix.ids] == [64] * 5 + [10]
    alone_a, alone_b = text_sequences(tok, a, 3 * 64, 64, seed=0), text_sequences(tok, b, 2 * 64 + 10, 64, seed=0)
    assert all(torch.equal(x, y) for x, y in zip(mix.ids[0::2], alone_a.ids, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(mix.ids[1::2], alone_b.ids, strict=True))
    assert set(mix.groups[1::2]) <= set(range(10, 15)) and set(mix.groups[0::2]) <= set(range(10))
    assert mix.parts == [0, 1, 0, 1, 0, 1] and mix.head(3).parts == [0, 1, 0] and alone_a.parts == []
    small = text_sequences(tok, Mixture(("a", "b"), (a, b)), 64, 64, seed=0)
    assert [len(s) for s in small.ids] == [32, 32] and torch.equal(small.ids[1], alone_b.ids[0][:32])
    with pytest.raises(KVFoldError, match="at least 2 tokens"):
        text_sequences(tok, Mixture(("a", "b"), (a, b)), 1, 64, seed=0)
