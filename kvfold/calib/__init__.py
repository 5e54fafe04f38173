"""Stage 1, calibration: run the model on tokens and accumulate per-head statistics.

tokens.py (what to feed) -> kvfold.hooks (what attention sees) -> sinks.py (Grams, streaming) ->
run.py (the loop) -> artifact.py (CalibStats on disk); spectrum.py/inspect.py read them back.
"""
