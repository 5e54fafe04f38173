"""What tests/bench/test_engine_host.py runs in the engine host: `python -m tests.bench.engine_host_child ACTION`."""

import os
import subprocess
import sys
import time

if __name__ == "__main__":
    action = sys.argv[1]
    print(f"argv={sys.argv[1:]} cwd={os.getcwd()} probe={os.environ.get('KVFOLD_PROBE')}")
    print("to stderr", file=sys.stderr)
    if action == "exit":
        sys.exit(int(sys.argv[2]))
    if action == "raise":
        raise ValueError("raised in the child")
    if action == "orphan":  # a process of its session that outlives it, as a vLLM worker can
        print(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid, flush=True)
    if action == "hang":  # writing its pid to argv[2], if given
        if len(sys.argv) > 2:
            with open(sys.argv[2], "w") as f:
                f.write(str(os.getpid()))
        time.sleep(600)
