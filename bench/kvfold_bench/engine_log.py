"""Reading why a vLLM process failed from what it printed (engine, workers and front end share the log)."""

from __future__ import annotations

import re

__all__ = ["root_cause"]


def root_cause(output: str) -> str:
    """The line that says why an engine failed: kvfold's refusal (the runtime's "kvfold: ..." or a bench
    child's one-line "error: ..."); else, when a worker died without raising (a crash leaves only its
    engine's "cancelled" behind), that it died and, for a segmentation fault, the native frame it died in;
    else the first exception vLLM reports (its later "Engine core initialization failed" only points back
    to it; warnings, such as the ulimit one that quotes an OSError, are not causes); else the last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for ln in lines:
        if "kvfold: " in ln:
            return ln.split("kvfold: ", 1)[1]
    for ln in lines:
        if ln.startswith("error: "):
            return ln.removeprefix("error: ")
    # a worker that raised first and then exited still names its exception: the exit code it dies with after
    # reporting the error (0 or None) races the engine's shutdown
    crash = re.search(r"Worker proc \S+ died unexpectedly \(exit code: (-?\d+)\)", output)
    if crash is not None and "Worker failed with error" not in output:
        code = int(crash.group(1))
        return (f"vLLM's worker process died (exit code {code}"
                + (f", a segmentation fault{_crash_frame(lines)})" if code == -11 else ")"))
    causes = [m.group(1) for ln in lines if (m := re.search(r"\b(\w*(?:Error|Exception): .*)", ln))
              and "Engine core initialization failed" not in ln and " WARNING " not in ln]
    return causes[0] if causes else (lines[-1] if lines else "no output")


def _crash_frame(lines: list[str]) -> str:
    """' in FUNCTION (FILE:LINE)': the first frame of the native stack that vLLM's crash handler printed
    below the signal handler's own, or '' when none was printed."""
    try:
        start = lines.index("!!!!!!! Segfault encountered !!!!!!!")
    except ValueError:
        return ""
    for ln in lines[start + 1:start + 8]:
        m = re.match(r'File "([^"]+)", line (\d+), in (.+)', ln)
        if m and "sigaction" not in m.group(1) and m.group(1) != "<unknown>":
            return f" in {m.group(3)} ({m.group(1).rsplit('/', 1)[-1]}:{m.group(2)})"
    return ""
