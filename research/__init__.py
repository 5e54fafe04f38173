"""Research code, in no wheel: references that say how far kvfold is from a limit, not parts of the product
or of the benchmarks. Run from the repository root with the development environment (scripts/setup.sh):

    .venv/bin/python -m research.frontier_limit ...   # the frontier with the ideal-coder references
    .venv/bin/python -m research.coder_bound ...      # the bits coder against the rate-distortion limit

ideal.py is the ideal coder both use; tests/research/ tests them (the repository root is on pytest's path)."""
