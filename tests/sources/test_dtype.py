"""fast_dtype: a half-precision checkpoint runs in its own dtype where this CPU multiplies it fast, else float32."""

import pytest

from kvfold.sources import models
from kvfold.sources.models import fast_dtype


@pytest.mark.parametrize(("fast", "want"), [(True, "bfloat16"), (False, "float32")])
def test_half_precision_falls_back_to_float32_only_on_a_cpu_where_it_is_slow(monkeypatch, fast, want):
    monkeypatch.setattr(models, "_cpu_half_is_fast", lambda dtype: fast)
    assert fast_dtype("bfloat16") == want
    assert fast_dtype("bfloat16", "cuda") == "bfloat16"  # a GPU runs what was asked
    assert fast_dtype("float32") == "float32"


def test_the_probe_measures_once_and_answers_per_dtype():
    models._cpu_half_is_fast.cache_clear()
    answer = models._cpu_half_is_fast("bfloat16")
    assert isinstance(answer, bool) and models._cpu_half_is_fast.cache_info().misses == 1
    assert models._cpu_half_is_fast("bfloat16") is answer and models._cpu_half_is_fast.cache_info().hits == 1
