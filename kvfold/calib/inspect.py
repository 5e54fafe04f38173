"""What a user looks at first: per layer, how many dims hold 90/99/99.9% of each spectrum's mass."""

from __future__ import annotations

from dataclasses import dataclass

from kvfold.calib.artifact import KINDS, CalibStats
from kvfold.calib.spectrum import dims_for_mass, svd_from_gram

__all__ = ["MASSES", "LayerSpectrum", "spectrum_table"]

MASSES = (0.90, 0.99, 0.999)


@dataclass(frozen=True)
class LayerSpectrum:
    layer: int
    # kind -> per mass level, the mean over heads of the dims needed (singular-value mass, as Eq. 6)
    dims: dict[str, tuple[float, ...]]


def spectrum_table(stats: CalibStats) -> list[LayerSpectrum]:
    rows = []
    for layer in range(stats.header.model.num_layers):
        dims = {}
        for kind in KINDS:
            sv, _ = svd_from_gram(stats.gram(layer, kind))  # [heads, d]
            dims[kind] = tuple(
                sum(dims_for_mass(s, m) for s in sv) / len(sv) for m in MASSES
            )
        rows.append(LayerSpectrum(layer=layer, dims=dims))
    return rows
