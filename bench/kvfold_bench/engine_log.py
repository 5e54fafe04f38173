"""Reading why a vLLM process failed from what it printed (engine, workers and front end share the log)."""

from __future__ import annotations

import re

__all__ = ["root_cause"]


def root_cause(output: str) -> str:
    """The line that says why an engine failed: kvfold's refusal (the runtime's "kvfold: ..." or a bench
    child's one-line "error: ..."), else the first exception vLLM reports (its later "Engine core
    initialization failed" only points back to it), else the last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for ln in lines:
        if "kvfold: " in ln:
            return ln.split("kvfold: ", 1)[1]
    for ln in lines:
        if ln.startswith("error: "):
            return ln.removeprefix("error: ")
    causes = [m.group(1) for ln in lines if (m := re.search(r"\b(\w*(?:Error|Exception): .*)", ln))
              and "Engine core initialization failed" not in ln]
    return causes[0] if causes else (lines[-1] if lines else "no output")
