"""Where captured vectors go. Each sink gets (name, x) with x: [heads, N, d] and returns Grams.

- GramSink: streaming float64 Gram XᵀX per head, on the vectors' device; memory O(d²) per head whatever N
  is. Its eigendecomposition is the SVD of the stacked X (σ_i² = λ_i, same right singular vectors). It also
  returns the keys' mean per head ("layers.i.k_mean", [H_kv, d]): the shift an export subtracts from every key
  (kvfold_runtime.format.K_SHIFT).
Every sink returns its Grams on the CPU.
- KMeansSink (ZDC): MiniBatchKMeans per head; the Gram is Σ_c n_c μ_c μ_cᵀ over count-weighted
  centroids. Needs two passes over the same data: fit, then count assignments to the final centroids.
- RecordSink: keeps the raw vectors (tests and debugging; memory O(N·d)).
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.cluster import MiniBatchKMeans

__all__ = ["GramSink", "KMeansSink", "RecordSink"]


class GramSink:
    passes = 1

    def __init__(self) -> None:
        self.grams: dict[str, torch.Tensor] = {}
        self.sums: dict[str, torch.Tensor] = {}  # keys only: Σ x per head, and how many vectors
        self.counts: dict[str, int] = {}

    def add(self, name: str, x: torch.Tensor, pass_idx: int = 0) -> None:
        x64 = x.to(torch.float64)  # [heads, N, d]; statistics are accumulated in float64
        gram = torch.bmm(x64.transpose(1, 2), x64)  # [heads, d, d]
        if name in self.grams:
            self.grams[name] += gram
        else:
            self.grams[name] = gram
        if name.endswith(".k"):
            self.sums[name] = self.sums.get(name, 0) + x64.sum(1)
            self.counts[name] = self.counts.get(name, 0) + x64.shape[1]

    def result(self) -> dict[str, torch.Tensor]:
        means = {f"{n}_mean": (s / self.counts[n]).cpu() for n, s in self.sums.items()}
        return {n: g.cpu() for n, g in self.grams.items()} | means


class RecordSink:
    passes = 1

    def __init__(self) -> None:
        self.vectors: dict[str, list[torch.Tensor]] = {}

    def add(self, name: str, x: torch.Tensor, pass_idx: int = 0) -> None:
        self.vectors.setdefault(name, []).append(x.detach().to(torch.float64).clone())

    def stacked(self, name: str) -> torch.Tensor:
        return torch.cat(self.vectors[name], dim=1)  # [heads, N, d]

    def result(self) -> dict[str, torch.Tensor]:
        return {n: ((x := self.stacked(n)).transpose(1, 2) @ x).cpu() for n in self.vectors}


class KMeansSink:
    passes = 2

    def __init__(self, k: int, seed: int) -> None:
        self.k, self.seed = k, seed
        self.models: dict[tuple[str, int], MiniBatchKMeans] = {}
        self.counts: dict[tuple[str, int], np.ndarray] = {}
        self.heads: dict[str, int] = {}

    def add(self, name: str, x: torch.Tensor, pass_idx: int = 0) -> None:
        xs = x.detach().to(torch.float64).cpu().numpy()
        self.heads[name] = xs.shape[0]
        for h, xh in enumerate(xs):
            key = (name, h)
            if pass_idx == 0:
                if key not in self.models:
                    self.models[key] = MiniBatchKMeans(
                        n_clusters=self.k, random_state=self.seed, n_init=1, batch_size=len(xh)
                    )
                self.models[key].partial_fit(xh)
            else:
                labels = self.models[key].predict(xh)
                counts = np.bincount(labels, minlength=self.k)
                self.counts[key] = self.counts.get(key, 0) + counts

    def result(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, heads in self.heads.items():
            per_head = []
            for h in range(heads):
                mu = torch.from_numpy(self.models[(name, h)].cluster_centers_).to(torch.float64)
                n = torch.from_numpy(self.counts[(name, h)]).to(torch.float64)
                per_head.append(mu.T @ (n[:, None] * mu))  # Σ_c n_c μ_c μ_cᵀ, [d, d]
            out[name] = torch.stack(per_head)
        return out
