"""research/frontier_limit.py: kvfold-bits' plans with an ideal coder, registered into the bench's frontier."""

from __future__ import annotations

from dataclasses import replace

import pytest
from typer.testing import CliRunner

from kvfold_bench.cli import app
from kvfold_bench.frontier.methods import DEFAULT, METHODS, PEERS, register
from research.frontier_limit import REFERENCES, register_references
from tests.bench.conftest import frontier_logits
from tests.bench.conftest import setup as setup  # the tiny frontier, a module fixture


def test_the_references_are_registered_by_name_only_and_the_bench_itself_knows_no_ideal_coder():
    register_references()
    register_references()  # again: nothing changes
    names = [m.name for m in REFERENCES]
    assert names == ["kvfold-bits-limit", "kvfold-bits-limit+2dB"]
    assert all(METHODS[n] is m for n, m in zip(names, REFERENCES, strict=True))
    assert not set(names) & (set(DEFAULT) | set(PEERS))
    with pytest.raises(ValueError, match="already registered"):
        register(replace(REFERENCES[0], label="another"))
    # the bench's frontier command takes them by name, and so lists them among its choices
    done = CliRunner().invoke(app, ["frontier", "--model", "smollm2", "--method", "nope"])
    assert done.exit_code == 2 and "kvfold-bits-limit+2dB" in done.stderr, done.output


def test_the_ideal_coder_references_store_kvfold_bits_plans_at_the_same_bytes_with_less_error(setup):
    """kvfold-bits-limit(+2dB): kvfold-bits' plans and bytes, the cache through research/ideal.py."""
    bits_method, limit_method, above_method = (replace(m, grid=(3.0,)) for m in (METHODS["kvfold-bits"], *REFERENCES))
    (bits,), (limit,), (above,) = (list(m.candidates(setup)) for m in (bits_method, limit_method, above_method))
    assert bits.kv_fraction == limit.kv_fraction == above.kv_fraction
    full = frontier_logits(setup)
    err = {name: float((frontier_logits(setup, c.patches) - full).square().mean())
           for name, c in (("bits", bits), ("limit", limit), ("above", above))}
    assert err["limit"] < err["above"] < err["bits"], err
