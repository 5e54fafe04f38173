"""What calibration feeds the model: random token ids (as in FDC) or windows of real text.

Each sequence carries a source group (the document its first token comes from; one group for random
tokens) so ZDC-style pruning can drop a fraction of sequences *per group*, keeping every topic.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from kvfold.errors import KVFoldError
from kvfold.sources.text import Mixture

__all__ = ["Sequences", "batches", "prune", "random_sequences", "text_sequences"]


@dataclass(frozen=True)
class Sequences:
    ids: list[torch.Tensor]  # each [L_i], int64; all L_i == seq_len except maybe the last
    groups: list[int]
    parts: list[int] = field(default_factory=list)  # a mixture's text index per window; [] = one text

    def head(self, n: int) -> Sequences:
        """The first n windows."""
        return Sequences(self.ids[:n], self.groups[:n], self.parts[:n])

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.ids)


def random_sequences(vocab_size: int, tokens: int, seq_len: int, seed: int) -> Sequences:
    gen = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, vocab_size, (tokens,), generator=gen)
    ids = list(stream.split(seq_len))
    return Sequences(ids=ids, groups=[0] * len(ids))


def text_sequences(tokenizer, docs: list[str] | Mixture, tokens: int, seq_len: int, seed: int) -> Sequences:
    """Pack documents (seeded order, separated by EOS) into windows until `tokens` are collected. A Mixture
    of n texts gives each text an equal share of whole windows (the first texts one more when they do
    not divide), taken in turn: window i comes from text i mod n. With fewer than n windows' worth of
    tokens, each text gives one window of tokens/n."""
    if isinstance(docs, Mixture):
        return _mixed(tokenizer, docs, tokens, seq_len, seed)
    order = np.random.default_rng(seed).permutation(len(docs))
    sep = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    stream: list[int] = []
    doc_of: list[int] = []
    for i in order:
        ids = tokenizer(docs[i], add_special_tokens=False)["input_ids"] + sep
        stream += ids
        doc_of += [int(i)] * len(ids)
        if len(stream) >= tokens:
            break
    if len(stream) < tokens:
        raise KVFoldError(f"the text holds only {len(stream)} tokens but --tokens is {tokens}; "
                          "lower --tokens or give more text")
    full = torch.tensor(stream[:tokens], dtype=torch.long)
    ids = list(full.split(seq_len))
    groups = [doc_of[k * seq_len] for k in range(len(ids))]
    return Sequences(ids=ids, groups=groups)


def _mixed(tokenizer, mix: Mixture, tokens: int, seq_len: int, seed: int) -> Sequences:
    n = len(mix.parts)
    if tokens < n:
        raise KVFoldError(f"{'+'.join(mix.specs)} mixes {n} texts: give at least {n} tokens")
    windows = -(-tokens // seq_len)
    if windows < n:  # too few tokens for a whole window each: one shorter window per text
        seq_len, windows = -(-tokens // n), n
    lengths = [min(seq_len, tokens - k * seq_len) for k in range(windows)]  # only the last may be short
    shares = [sum(lengths[i::n]) for i in range(n)]  # window k comes from text k mod n
    each = [text_sequences(tokenizer, docs, share, seq_len, seed)
            for docs, share in zip(mix.parts, shares, strict=True)]
    # groups (documents, for pruning) stay distinct across texts: text i's are offset by the documents before it
    offsets = [sum(len(d) for d in mix.parts[:i]) for i in range(n)]
    ids, groups = [], []
    for k in range(windows):
        part, j = k % n, k // n
        ids.append(each[part].ids[j])
        groups.append(each[part].groups[j] + offsets[part])
    return Sequences(ids=ids, groups=groups, parts=[k % n for k in range(windows)])


def prune(seqs: Sequences, fraction: float, seed: int) -> Sequences:
    """Drop `fraction` of the sequences of each group (seeded). A group of n sequences loses
    floor(f*n) plus one more with probability frac(f*n), so the expected fraction is exact."""
    assert 0.0 <= fraction < 1.0, fraction  # validated by the API
    if fraction == 0.0:
        return seqs
    rng = np.random.default_rng(seed)
    by_group: dict[int, list[int]] = {}
    for idx, g in enumerate(seqs.groups):
        by_group.setdefault(g, []).append(idx)
    drop: set[int] = set()
    for g in sorted(by_group):
        members = by_group[g]
        exact = fraction * len(members)
        n_drop = int(exact) + int(rng.random() < exact - int(exact))
        drop.update(rng.choice(members, size=n_drop, replace=False).tolist())
    keep = [i for i in range(len(seqs.ids)) if i not in drop]
    if not keep:
        raise KVFoldError(f"--prune {fraction} leaves no sequence; use a smaller fraction")
    return Sequences(ids=[seqs.ids[i] for i in keep], groups=[seqs.groups[i] for i in keep],
                     parts=[seqs.parts[i] for i in keep] if seqs.parts else [])


def batches(seqs: Sequences, batch: int) -> Iterator[torch.Tensor]:
    """Yield [B, L] batches of consecutive equal-length sequences (the short tail goes alone)."""
    run: list[torch.Tensor] = []
    for s in seqs.ids:
        if run and (len(run) == batch or len(s) != len(run[0])):
            yield torch.stack(run)
            run = []
        run.append(s)
    if run:
        yield torch.stack(run)
