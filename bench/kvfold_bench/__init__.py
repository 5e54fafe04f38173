"""Benchmark commands (`python -m kvfold_bench ...`): each prints JSON measured in that run."""
