"""python -m kvfold.bench ... (the same commands as the `kvfold-bench` console script)."""

from kvfold.bench.cli import main

if __name__ == "__main__":
    main()
