"""python -m kvfold_bench ... (the same commands as the `kvfold-bench` console script)."""

from kvfold_bench.cli import main

if __name__ == "__main__":
    main()
