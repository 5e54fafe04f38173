"""Stage 2, plan: per-head ranks from a removal rate (ranks.py), candidates scored on text
(evaluate.py), and the search for the largest compression meeting an accuracy target (search.py)."""
