"""python -m kvfold.bench ... (the same commands as `kvfold bench ...`)."""

from kvfold.bench.cli import app

if __name__ == "__main__":
    app()
