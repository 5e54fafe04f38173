"""Any cache method with its first S tokens and each query's W most recent ones kept at the model's dtype (issue 51:
the attention sinks and the recent window whole, only the history compressed, as OSCAR's 64 + 256 BF16 tokens and
KIVI's full-precision residual do). `--method NAME:sSwW` (e.g. `kvfold-bits:s64w256@3,2.5`, `kivi2:s0w128`).

What a query reads: hooks.AttentionPatch.exact, which scores each query against its own view of the cache (a
token enters the history when it leaves the query's window), so one forward pass over a long window scores every
position as a decode at that position would see it. Bytes per token at the scored context T (Setup.context): the
S + W whole tokens at 2 bytes a number, as fp16's, and the T − S − W others at the method's own fraction f:
(S + W + (T − S − W)·f) / T. At 32K (`fraction_at`) the same with T = 32,768.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from kvfold.errors import KVFoldError

from .base import Candidate, Method

__all__ = ["Recent", "fraction_at"]


def fraction_at(context: int, sinks: int, window: int, fraction: float) -> float:
    """KV bytes per token over fp16's at `context` tokens, the sinks and the window whole."""
    whole = min(context, sinks + window)
    return (whole + (context - whole) * fraction) / context


@dataclass(frozen=True)
class Recent:
    inner: Method
    sinks: int
    window: int

    @property
    def name(self) -> str:
        return f"{self.inner.name}:s{self.sinks}w{self.window}"

    @property
    def label(self) -> str:
        return f"{self.inner.label}, first {self.sinks} + last {self.window} tokens whole"

    @property
    def knob(self) -> str:
        return self.inner.knob

    @property
    def origin(self) -> str | None:
        return None  # its mildest point is its own: the sinks and window change every point

    def candidates(self, setup) -> Iterator[Candidate]:
        from .kvfold import KVFold
        from .uniform import Uniform

        if isinstance(self.inner, (KVFold, Uniform)):  # q projected onto kept dims, whatever the key
            raise KVFoldError(f"--method {self.name}: {self.inner.name} is a rank method (its cache is the projection "
                              "itself, with no rounding to keep whole); a window applies to methods that round")
        for cand in self.inner.candidates(setup):
            if cand.proj_maps:
                raise KVFoldError(f"--method {self.name}: {self.inner.name} changes the projections themselves "
                                  "(no cache to keep whole); a window applies to methods that change the cache")
            if any(p.after is not None and p.whole is None for p in cand.patches.values()):
                raise KVFoldError(f"--method {self.name}: {self.inner.name} maps attention to another basis without "
                                  "saying what its whole tokens are (AttentionPatch.whole)")
            patches = {i: dataclasses.replace(p, exact=(self.sinks, self.window)) for i, p in cand.patches.items()}
            yield Candidate(cand.knob, fraction_at(setup.context, self.sinks, self.window, cand.kv_fraction),
                            patches, kv_fraction_32k=fraction_at(32768, self.sinks, self.window, cand.kv_fraction))
