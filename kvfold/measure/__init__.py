"""Stage 3, measurement: how close a compressed model is to the original, used by the plan's search and by
verify alike. evaluate.py scores a model, whole or patched, on text windows; metrics.py holds those
next-token figures (top-1, perplexity, agreement, KL) with paired standard errors; stored.py runs attention
on what a compressed cache stores (a patch, no export); passkey.py builds and scores the long-context
pass-key task."""
