"""The kvfold wheel holds the compiler only: the benchmarks (bench/, kvfold_bench) and the serving runtime
(runtime/, kvfold_runtime) are packages of their own, and research/ ships in no wheel."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_kvfold_wheel_holds_the_kvfold_package_and_its_console_script_only(tmp_path):
    # a copy of the source tree, bench/ and research/ included: setuptools builds in the tree it is given
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "docs", "build", "*.egg-info", "__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                           "--disable-pip-version-check", str(src), "-w", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("kvfold-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"kvfold"}, sorted(tops)
    assert not [n for n in names if "bench" in n.split("/")[:-1] or "research" in n], names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "kvfold = kvfold.cli:main" in scripts and "kvfold-bench" not in scripts, scripts
