"""Build time of each test environment (tests/environments_harness.py): cold, into an empty
store (mmdebstrap and every RUN step run), then cached (the same Dockerfiles again: every
step a cache hit), and each one's size.

    SRT_TEST_RUNTIME_DIR=/work/main/.runtime .venv/bin/python bench/bench_environments.py
        [--keep DIR]

Needs root, mmdebstrap, bubblewrap and the registries (Debian's archive, PyPI) reachable.
The store is a temporary directory removed at the end (--keep DIR: build there and keep it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from environments_harness import ORDER, build_all  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="srt-bench-env-"))
    base = args.keep or work / "environments"
    try:
        results: dict[str, dict[str, float]] = {}
        for phase in ("cold", "cached"):
            started = time.monotonic()
            built = build_all(base, work / phase)
            for name in ORDER:
                results.setdefault(name, {})[f"{phase}_s"] = round(built.seconds[name], 1)
            results.setdefault("all", {})[f"{phase}_s"] = round(time.monotonic() - started, 1)
        for name in ORDER:
            results[name]["size_mb"] = round(built.get(name).size_bytes / 2**20)
        print(json.dumps(results, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
