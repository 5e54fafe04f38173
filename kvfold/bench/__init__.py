"""Benchmark commands (`python -m kvfold.bench ...`): each prints JSON measured in that run."""
