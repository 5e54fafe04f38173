"""Export options as a pydantic model; a YAML recipe is the same model on disk.

`Recipe.model_validate(yaml.safe_load(text))`; unknown keys are errors, so a typo never passes silently. Flags
given on the command line are a `RecipeOverrides` (every field, None where not given) laid over the file
(`load_recipe`). The defaults are defined here only: the CLI's help reads them from `Recipe.model_fields`.
Torch-free, so that `kvfold export --help` answers at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from kvfold.errors import KVFoldError
from kvfold.plan.criteria import Target
from kvfold.plan.formats import DEFAULT_FORMAT, FORMATS, get_format

__all__ = ["DEFAULT_METRIC", "Recipe", "RecipeOverrides", "load_recipe"]

DEFAULT_METRIC = "joint"  # with --max-kl: kl


class Recipe(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    accuracy: float | None = Field(default=None, gt=0.0, le=1.0)  # keep ≥ this fraction (see plan/criteria.py)
    ratio: float | None = Field(default=None, ge=0.0, lt=1.0)  # or: reach this KV compression p
    max_kl: float | None = Field(default=None, gt=0.0)  # or: mean KL(original ‖ compressed) ≤ this, nats
    method: Literal["aware", "zack"] = "aware"
    # joint: top-1 ratio ≥ A and perplexity ratio ≤ 1/A (plan/criteria.py says why it is the default)
    metric: Literal["joint", "top1", "ppl", "agree", "kl"] = None  # type: ignore[assignment]  # set below
    # half Wikipedia, half Python's docs (sources/text.py): a promise measured on one domain did not hold on
    # the other (README "Accuracy out of domain")
    eval_text: str = "wiki:dev+pydoc:dev"
    eval_tokens: int = Field(default=16384, ge=1)  # ±0.4% standard error on SmolLM2 top-1 ratio
    # The windows every candidate is scored on: `search_context` tokens each, every prediction from position
    # `score_from` on. None: the format's for the cache (plan/formats resolve): a cache that keeps a window whole is
    # judged at long context, 4,096 tokens from position 1,024 on (issue 51: its recent window must not hide the
    # error of its history), else in 512-token windows from the first position (short-context serving).
    search_context: int | None = Field(default=None, ge=16)
    score_from: int | None = Field(default=None, ge=1)
    multiple: int = Field(default=8, ge=1)  # round ranks up to this (16 for GPU kernels)
    min_rank: int = Field(default=8, ge=0)
    # r_v = v_scale · r_k along the searched family (bits: θ_v = v_scale · θ_k); None: the format's (plan/formats;
    # bits: keys need more bits than one θ gives them)
    v_scale: float = Field(default=None, gt=0.0)  # type: ignore[assignment]  # set below
    # eq6: one r (bits: one θ) for every head, as in the papers. sensitivity: multipliers measured once per export on
    # the first sensitivity_tokens of eval_text. Rank format: per layer, from the NLL cost of removing dims
    # (plan/sensitivity.py); that cut layers long-range retrieval needs: with the pass-key check (plan/longrange.py)
    # SmolLM2's 0.99 export kept p = 0.0201 with eq6 and 0.0111 with sensitivity (README "Long context"). Bits
    # format: per KV head, from the KL cost of rounding (plan/rounding.py): KL −25% at equal bytes, but SmolLM2's
    # 0.99 export with it (0.295 of fp16's bytes, 2026-11-28) lost 1 of 10 pass keys in the runtime that its
    # simulated check kept. So eq6 is both formats' default (None: the format's default, plan/formats).
    allocation: Literal["sensitivity", "eq6"] = None  # type: ignore[assignment]  # set below
    # None: the format's (rank: 4,096; bits: 2,048, its probes are per KV head: 2 × layers × KV heads of them)
    sensitivity_tokens: int = Field(default=None, ge=1)  # type: ignore[assignment]  # set below
    # Every bound of the target is checked `margin` paired standard errors on the unfavourable side: a
    # lower confidence bound instead of the point estimate (1.0 ≈ 84% one-sided; 0 = the plain
    # definition). With ±0.3% standard error on 16K tokens, the point estimate alone lands under the
    # target on other text about half the time (measured: held-out 0.9885 for a 0.9906 search point).
    margin: float = Field(default=1.0, ge=0.0)
    # Bisection steps of the accuracy search (plan/search.py), each one candidate scored: after the mildest point,
    # each halves the interval of log rate left. 8 leave the chosen point within 2.5% (rank) or 5.5% (bits) of the
    # edge's rate; fewer score fewer candidates (a quicker export) and may keep a milder point than the edge.
    search_steps: int = Field(default=8, ge=1, le=32)
    # rank: the cache stores k', v' at the chosen ranks in the model's dtype. bits: each kept dim in a band of
    # 2–16 bits with per-token scales (plan/bits.py, kvfold_runtime.bands); ranks follow from the bits, so
    # multiple and min_rank do not apply. Served by the transformers runtime and the vLLM plugin. A name in
    # plan/formats.FORMATS, whose class decides everything that differs between formats.
    format: str = DEFAULT_FORMAT
    # Bits format: every band of a KV head starts and ends on a multiple of this many dims (plan/bits.dim_bits), as
    # the aligned GPU decode kernel reads the codes; 1: bands anywhere (the allocation before issue 50, for
    # comparison). None: the format's for the model's head_dim, set by plan/reuse.check_inputs (bits: 8 at head_dim
    # ≤ 64, else 16, plan/formats/bits.band_align_for; the rank format has no bands and refuses it).
    band_align: int | None = Field(default=None, ge=1)
    # Bits format: every layer also keeps its first `sinks` and its last `window` tokens whole (2 bytes a number),
    # and a query reads them whole and the rest from the codes (issue 51: attention sinks and the recent tokens take
    # most of the attention). The search and the pass keys score that cache; bytes are stated at 4,096 tokens
    # (plan/bits.WINDOW_CONTEXT). Served by the transformers runtime and vLLM (no prefix caching). 0 and 0: none.
    # None: the format's for the model (plan/formats/bits.py: 16 and 64 where its positions reach 4,096).
    sinks: int | None = Field(default=None, ge=0)
    window: int | None = Field(default=None, ge=0)
    # Bits format: keys are never dropped nor stored below this many bits. None: plan/bits.KEY_MIN_BITS (4) in the
    # plain bits cache; in the windowed one 2 where that keeps the pass keys, else 4 (plan/formats/bits.py).
    key_bits: int | None = Field(default=None, ge=2, le=16)
    # RoPE models: the query/key statistics are averaged over positions [0, context) before the factors are
    # fitted (factors/positions.py), so keys late in a long sequence keep their dims; None: the model's
    # max_position_embeddings. 0: as calibrated (positions 0–511 only; loses long-context retrieval).
    context: int | None = Field(default=None, ge=0)
    # The dtype the model runs in while candidates are scored and the pass keys checked (bfloat16: ~4x faster on a
    # CPU with AMX, the usual choice on a GPU); auto: sources.models.run_dtype's rule, resolved before planning.
    # Statistics and factors stay float64, and the written weights keep the source checkpoint's dtype; the recorded
    # figures are the ones measured in this dtype (verify re-measures).
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Long context: of the points meeting the target, choose the most compressed that retrieves as many pass
    # keys in prompts of this many tokens (capped at the model's context) as the original (plan/longrange.py).
    # 0: skip (an export for short contexts only).
    passkey: int = Field(default=4096, ge=0)
    # Balance every layer's widths over this many tensor-parallel ranks (vLLM's --tensor-parallel-size): each
    # rank's KV heads then hold equal widths, so no rank pads its cache (plan/ranks.balance,
    # kvfold_runtime.sharding). Rank format; must divide the model's KV heads.
    tp: int = Field(default=1, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _default_metric(cls, data):
        if isinstance(data, dict) and data.get("metric") is None:
            data = {**data, "metric": "kl" if data.get("max_kl") is not None else DEFAULT_METRIC}
        if isinstance(data, dict):
            # an unknown format takes the default's, so that its own error (_known_format) is the one reported
            name = data.get("format")
            fmt = FORMATS.get(name, FORMATS[DEFAULT_FORMAT]) if isinstance(name, str) else FORMATS[DEFAULT_FORMAT]
            defaults = {"v_scale": fmt.v_scale, "allocation": fmt.allocation,
                        "sensitivity_tokens": fmt.sensitivity_tokens}
            data = {**data, **{k: v for k, v in defaults.items() if data.get(k) is None}}
        return data

    @field_validator("format")
    @classmethod
    def _known_format(cls, name: str) -> str:
        get_format(name)
        return name

    @model_validator(mode="after")
    def _one_target(self) -> Recipe:
        if sum(x is not None for x in (self.accuracy, self.ratio, self.max_kl)) != 1:
            raise ValueError("give exactly one of accuracy, ratio or max_kl")
        if (self.metric == "kl") != (self.max_kl is not None) and self.ratio is None:
            raise ValueError("the kl metric takes --max-kl X (nats), the others --accuracy A")
        if self.score_from is not None and self.search_context is not None and self.score_from >= self.search_context:
            raise ValueError(f"--score-from must be less than --search-context ({self.search_context} tokens)")
        if 0 < self.passkey < 256:
            raise ValueError("passkey must be 0 (skip) or at least 256 tokens")
        get_format(self.format).check(self)  # what this format refuses (bits: --tp, --ratio; rank: --band-align)
        return self

    def target(self) -> Target | None:
        """The accuracy target, None for a compression target."""
        if self.ratio is not None:
            return None
        return Target(self.metric, self.max_kl if self.metric == "kl" else self.accuracy, self.margin)

    @property
    def rounding(self) -> tuple[int, int]:
        """(multiple, min_rank) the ranks are rounded with, as the format rounds them (the bits format's ranks follow
        from its bits: (band_align, 0))."""
        return get_format(self.format).rounding(self)


def _as_given(annotation):
    """A Recipe field's type as a flag gives it: optional, and a choice (Literal) any string, which Recipe checks."""
    return (str if get_origin(annotation) is Literal else annotation) | None


# Recipe fields given explicitly (the command line's flags), None where not given: the file's value or the default
# then. Derived from Recipe, so each option is declared once; Recipe checks bounds and choices (load_recipe), and
# its messages name the flag.
RecipeOverrides = create_model(
    "RecipeOverrides", __config__=ConfigDict(frozen=True, extra="forbid"),
    **{name: (_as_given(field.annotation), None) for name, field in Recipe.model_fields.items()})


def load_recipe(path: Path | None, overrides: RecipeOverrides | Mapping | None = None) -> Recipe:
    """Recipe from a YAML file (if given) with explicitly passed options on top (a RecipeOverrides, or a mapping
    of the same fields); errors in one line."""
    data: dict = {}
    given: dict = {}
    if path is not None:
        if not Path(path).is_file():
            raise KVFoldError(f"recipe '{path}' does not exist")
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as e:
            raise KVFoldError(f"recipe '{path}' is not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise KVFoldError(f"recipe '{path}' must be a mapping of option: value")
    try:
        if overrides is not None:
            given = (overrides if isinstance(overrides, RecipeOverrides) else RecipeOverrides.model_validate(
                dict(overrides))).model_dump(exclude_none=True)
        if {"accuracy", "ratio"} & set(given):  # a target flag replaces the file's target
            data.pop("accuracy", None)
            data.pop("ratio", None)
        return Recipe.model_validate(data | given)
    except ValidationError as e:
        err = e.errors()[0]
        flag = "--" + ".".join(str(p) for p in err["loc"]).replace("_", "-") if err["loc"] else "options"
        msg = err["msg"].removeprefix("Value error, ")
        raise KVFoldError(f"{flag}: {msg}" + (f" (in {path})" if path else "")) from None
