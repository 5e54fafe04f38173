"""What a cache format is: everything `kvfold export --format NAME` does differently for one format, in one class
(as llm-compressor has one modifier per method). The planner, the recipe, --reuse-curve and the manifest ask the
format object and never test its name; a new format is a subclass and a line in `kvfold.plan.formats.FORMATS`.

A format owns its defaults (v_scale, allocation, sensitivity tokens), the recipe options it refuses, how ranks
are rounded, which sensitivity --allocation sensitivity measures, how the search's knob r becomes a rule and the
rule a plan, the range that search runs over, the pass-key check's caches, and what the export records.

The checkpoint's layout is the runtime's to define (kvfold_runtime.format): a cache in the model's dtype at the
kept ranks (`rank`), or in bit bands (`bits`); `ConfigBlock.format` names it from config.json. A format declares
the `layout` it writes, so a new format needs no runtime change as long as it writes one the runtime reads: the
runtime serves the checkpoint by its layout, and the manifest names the format (`Manifest.format`) only where the
layout does not already name it, which keeps every rank and bits manifest as it was written before formats were
classes.

Torch-free at import: plan/recipe.py reads the registry, and `kvfold export --help` must answer at once; the
planning methods import the torch modules they run (plan/ranks.py, plan/bits.py, ...) where they run them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvfold.factors import LayerBasis, LayerFactors
    from kvfold.measure.evaluate import Evaluator
    from kvfold.plan.bits import BitPlan, BitRule
    from kvfold.plan.criteria import Target
    from kvfold.plan.point import Point
    from kvfold.plan.ranks import RankPlan, RankRule
    from kvfold.plan.recipe import Recipe
    from kvfold.plan.rounding import HeadScales
    from kvfold.plan.sensitivity import LayerScales

__all__ = ["LONG_CONTEXT", "SHORT_CONTEXT", "CacheFormat", "scoring_windows"]

# A cache that keeps a recent window whole is judged at long context: the search scores windows of LONG_CONTEXT
# tokens (or the model's positions, if fewer) from a quarter of the way in, so the window is a small share of what
# each scored token reads (issue 51: at 512 tokens a 64-token window hides the history's error). Other caches: 512
# tokens from the first position, the serving context every earlier export was judged at.
LONG_CONTEXT = 4096
SHORT_CONTEXT = 512


def scoring_windows(recipe: Recipe, positions: int) -> Recipe:
    """`recipe` (its sinks and window resolved) with the search's windows filled in where not given, and checked."""
    from kvfold.plan.recipe import Recipe  # the recipe imports the formats: only at call time

    windowed = bool(recipe.sinks or recipe.window)
    context = recipe.search_context or (min(LONG_CONTEXT, positions or LONG_CONTEXT) if windowed else SHORT_CONTEXT)
    score_from = recipe.score_from or (context // 4 if windowed else 1)
    return Recipe.model_validate({**recipe.model_dump(), "search_context": context, "score_from": score_from})


class CacheFormat:
    name: ClassVar[str]  # Recipe.format, --format
    layout: ClassVar[str]  # the checkpoint layout it writes, as the runtime names it (ConfigBlock.format)
    summary: ClassVar[str]  # one line for --format's help
    frontier_method: ClassVar[str]  # its curve in `kvfold-bench frontier` (bench/kvfold_bench/frontier/methods)
    v_scale: ClassVar[float]  # Recipe.v_scale's default: r_v = v_scale · r_k along the searched family
    # Recipe.band_align's default as --help says it (resolve() fills it in for the model); None: no bands, refused
    band_align_default: ClassVar[str | None] = None
    allocation: ClassVar[str] = "eq6"  # Recipe.allocation's default
    sensitivity_tokens: ClassVar[int]  # Recipe.sensitivity_tokens' default
    sensitivity_of: ClassVar[str]  # what --allocation sensitivity measures, as the log says it ("each ... sensitivity")
    # whether that probe compares with the original's predictions (a KL) or needs only the NLL (cheaper)
    sensitivity_compares: ClassVar[bool]

    # -- the recipe (torch-free) --

    def check(self, recipe: Recipe) -> None:
        """ValueError, its message saying the fix, for options this format refuses; none by default."""

    def resolve(self, recipe: Recipe, head_dim: int, positions: int) -> Recipe:
        """The recipe with the defaults that depend on the model (its head_dim, the positions it reaches) filled
        in: by default no whole tokens, and the scoring windows for the cache (scoring_windows)."""
        return scoring_windows(recipe.model_copy(update={"sinks": recipe.sinks or 0, "window": recipe.window or 0}),
                               positions)

    def rounding(self, recipe: Recipe) -> tuple[int, int]:
        """(multiple, min_rank) the ranks are rounded with: the recipe's own by default."""
        return recipe.multiple, recipe.min_rank

    @property
    def band_scale(self) -> str | None:
        """The bands' scale format its exports store (kvfold_runtime.bands.SCALES), which a reused curve must
        share; None: no bands."""
        return None

    @property
    def manifest_name(self) -> str | None:
        """What the manifest's `format` records: None where the layout already names this format."""
        return None if self.name == self.layout else self.name

    def key_floors(self, recipe: Recipe) -> tuple[int | None, ...]:
        """The keys' narrowest widths (Recipe.key_bits) to search in turn, each taken if its point keeps the pass
        keys as it is (plan/planner._search_floors); the last one's check is the usual one. By default the
        recipe's own, one search."""
        return (recipe.key_bits,)

    # -- planning (subclasses) --

    def rule(self, recipe: Recipe, r: float, r_v: float, multipliers: dict) -> RankRule | BitRule:
        """The searched family's member at knob (r, r_v); `multipliers`: the rule's per-layer or per-head ones."""
        raise NotImplementedError

    def plan(self, bases: list[LayerBasis], rule) -> RankPlan | BitPlan:
        """The plan a rule gives: anything with `compression` and `key()` (plan/search.py)."""
        raise NotImplementedError

    def scorer(self, bases: list[LayerBasis], evaluator: Evaluator) -> Callable:
        """plan -> (candidate's metrics, the original's), each plan scored on the cache it would store."""
        raise NotImplementedError

    def export_parts(self, bases: list[LayerBasis], rule) -> tuple[RankPlan, BitPlan | None, list[LayerFactors]]:
        """The chosen rule's ranks, bits (None: no bands) and the factors export bakes."""
        raise NotImplementedError

    def sensitivity(self, bases: list[LayerBasis], probe: Evaluator, recipe: Recipe,
                    log: Callable[[str], None]) -> LayerScales | HeadScales:
        """The multipliers of --allocation sensitivity, measured on `probe`."""
        raise NotImplementedError

    def passkey_patches(self, bases: list[LayerBasis], evaluator: Evaluator, rule, like) -> list[dict]:
        """The caches the pass-key check runs a point on (plan/longrange.py): every one must keep the keys."""
        raise NotImplementedError

    def search_range(self, rule: Callable[[float], RankRule | BitRule]) -> tuple[float, float]:
        """(mildest, harshest) knob of the accuracy search."""
        return 1e-3, 0.5

    # -- shared --

    def search(self, bases: list[LayerBasis], evaluator: Evaluator, target: Target, rule: Callable, *, steps: int,
               progress=None, remember: Callable = lambda score: score) -> tuple[Point, list[Point]]:
        """The most compressed point meeting `target` along the family `rule`, and every point scored;
        `remember` wraps the scorer (plan/journal.py keeps what it scores)."""
        from kvfold.plan.search import search_rate

        r_lo, r_hi = self.search_range(rule)
        return search_rate(lambda rr: self.plan(bases, rr), remember(self.scorer(bases, evaluator)), target, rule,
                           r_lo=r_lo, r_hi=r_hi, steps=steps, progress=progress)

    def measure(self, bases: list[LayerBasis], evaluator: Evaluator, rule,
                remember: Callable = lambda score: score) -> Point:
        """One point scored as the search scores its candidates."""
        from kvfold.plan.point import Point

        plan = self.plan(bases, rule)
        cand, base = remember(self.scorer(bases, evaluator))(plan)
        return Point.measured(rule.r_k, rule.r_v, plan.compression, cand, base)
