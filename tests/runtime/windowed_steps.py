"""What the windowed-format tests over a paged cache share (test_paged_window on the CPU paths, test_triton_pages_window
on the GPU page layout): the definition a query is checked against, and the schedule of steps by which requests'
tokens arrive (prefills, chunks and decodes mixed in one batch, as vLLM's scheduler gives them)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvfold_runtime.kernels.reference import reference_attention


def oracle(q, k, v, coded_k, coded_v, i: int, sinks: int, window: int, d_k: list[int], d_v: list[int], group: int,
           scaling: float) -> torch.Tensor:
    """Query row q at position i by the definition: a row-by-row reference on keys mixed per position, token j
    whole where j < sinks or i − j < window, from its codes elsewhere."""
    whole = torch.tensor([j < sinks or i - j < window for j in range(i + 1)])[:, None]
    keys = torch.where(whole, k[:i + 1], coded_k[:i + 1])
    values = torch.where(whole, v[:i + 1], coded_v[:i + 1])
    return reference_attention(q[None, None], keys[None], values[None], d_k, d_v, group, scaling=scaling)[0, 0]


@dataclass
class Step:
    reqs: list[int]  # the requests in this step, in batch order
    pos: list[torch.Tensor]  # each one's positions this step
    lens: list[int]  # each one's length after it
    starts: torch.Tensor  # query_start_loc [len(reqs) + 1]

    def gather(self, per_request: list[torch.Tensor]) -> torch.Tensor:
        """The step's rows of a per-request tensor [tokens, ·], in batch order."""
        return torch.cat([per_request[r][p] for r, p in zip(self.reqs, self.pos, strict=True)])

    def slots(self, table: torch.Tensor, block_size: int) -> torch.Tensor:
        """vLLM's slot mapping of the step's tokens: block · block_size + place in the block."""
        return torch.cat([table[r, p // block_size].long() * block_size + p % block_size
                          for r, p in zip(self.reqs, self.pos, strict=True)])


def steps(schedule: list[list[int]]) -> Iterator[Step]:
    """The steps of `schedule` (per request, the tokens each step brings; 0: not in that step)."""
    done = [0] * len(schedule)
    for step in range(len(schedule[0])):
        reqs = [r for r in range(len(schedule)) if schedule[r][step]]
        news = [schedule[r][step] for r in reqs]
        lens = [done[r] + n for r, n in zip(reqs, news, strict=True)]
        pos = [torch.arange(done[r], lens[i]) for i, r in enumerate(reqs)]
        yield Step(reqs, pos, lens, torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int32))
        for r, n in zip(reqs, lens, strict=True):
            done[r] = n
