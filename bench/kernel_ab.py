"""Time the balanced runner of several versions of the Triton kernel side by side.

A kernel edit that should speed up the serving buckets is judged against the kernel it
replaces on the same machine, in one run: each `NAME=FILE` is a version of
kernels/triton/mla_decode.py (e.g. `git show main:kernels/triton/mla_decode.py > /tmp/a.py`).
Each gets a copy of this checkout's packages with that file in place, and
bench/paged_read_cost.py runs there with the same arguments (a given config, so no DB
winners are needed, and the chosen layouts). The versions compile in parallel (one process
per version and layout, the steps run once untimed), then are timed one after another,
`--rounds` times in turn, so a drift of the machine shows as a spread between rounds
instead of a difference between versions. Every timed layout's last step is checked
against the float32 reference by paged_read_cost itself (its error column).

    python3 bench/kernel_ab.py base=/tmp/base.py new=kernels/triton/mla_decode.py -- \\
        --batch 128 --format fp8 --pages 64 --config block_n=64,num_stages=3,fast_mode=1,kv_load=tma \\
        --programs 264 --seg-cost 8 --layouts "tokens tma,paged 64 shuffled tma"

Prints one markdown table: a row per layout, a column per version and round (µs per
step, max abs error).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bench", "configs", "kernels", "mla_tune")
KERNEL = Path("kernels/triton/mla_decode.py")
ROW = re.compile(r"^\| (.+?) \| ([0-9.]+|nan) \| ([0-9.e+-]+|nan|inf) \|$")


def checkout_with(kernel: Path, where: Path) -> Path:
    """A copy of this checkout's packages under `where` with `kernel` as the Triton kernel."""
    where.mkdir(parents=True)
    for name in PACKAGES:
        shutil.copytree(ROOT / name, where / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(ROOT / "pyproject.toml", where / "pyproject.toml")
    shutil.copy2(kernel, where / KERNEL)
    return where


def run_in(tree: Path, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """bench/paged_read_cost.py with `args`, importing everything from `tree`."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tree)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                       if p and Path(p).resolve() != ROOT]))
    return subprocess.run([sys.executable, "bench/paged_read_cost.py", *args], cwd=tree,
                          env=env, capture_output=True, text=True, timeout=timeout)


def table_rows(stdout: str) -> dict[str, tuple[str, str]]:
    """layout -> (µs per step, max abs error) from paged_read_cost's table."""
    return {m.group(1): (m.group(2), m.group(3))
            for m in (ROW.match(line.strip()) for line in stdout.splitlines())
            if m and m.group(1) != "layout"}


def layouts_of(args: list[str]) -> list[str]:
    """The layouts `--layouts` names in paged_read_cost's arguments (needed to warm each)."""
    for i, a in enumerate(args):
        if a == "--layouts" and i + 1 < len(args):
            return [x.strip() for x in args[i + 1].split(",") if x.strip()]
        if a.startswith("--layouts="):
            return [x.strip() for x in a.split("=", 1)[1].split(",") if x.strip()]
    raise SystemExit("give paged_read_cost's --layouts (the layouts to compile and time)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="%(prog)s NAME=FILE ... [--rounds N] -- ARGS")
    ap.add_argument("versions", nargs="+", help="NAME=FILE: a version of the kernel file")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    argv = sys.argv[1:]
    if "--" not in argv:
        ap.error("give paged_read_cost's arguments after --")
    cut = argv.index("--")
    a = ap.parse_args(argv[:cut])
    passed = argv[cut + 1:]
    versions: dict[str, Path] = {}
    for item in a.versions:
        name, _, file = item.partition("=")
        path = Path(file)
        if not name or not path.is_file() or name in versions:
            ap.error(f"{item!r}: expected NAME=FILE, a distinct name and an existing file")
        versions[name] = path.resolve()
    layouts = layouts_of(passed)
    with tempfile.TemporaryDirectory(prefix="kernel_ab_") as tmp:
        trees = {n: checkout_with(f, Path(tmp) / n) for n, f in versions.items()}

        def warm(job: tuple[str, str]) -> tuple[str, str, int, str]:
            name, layout = job
            proc = run_in(trees[name], [*passed, "--only", layout], a.timeout)
            return name, layout, proc.returncode, proc.stderr[-1500:]

        jobs = [(n, lay) for n in trees for lay in layouts]
        with ThreadPoolExecutor(len(jobs)) as pool:
            for name, layout, rc, err in pool.map(warm, jobs):
                if rc:
                    raise SystemExit(f"{name}, {layout}: failed (exit {rc}):\n{err}")
        results: dict[tuple[str, int], dict[str, tuple[str, str]]] = {}
        for r in range(a.rounds):
            for name, tree in trees.items():
                proc = run_in(tree, passed, a.timeout)
                if proc.returncode:
                    raise SystemExit(f"{name}: failed (exit {proc.returncode}):\n"
                                     f"{proc.stderr[-1500:]}")
                results[(name, r)] = table_rows(proc.stdout)
    cols = [(n, r) for r in range(a.rounds) for n in versions]
    print("| layout | " + " | ".join(f"{n} (round {r + 1}): µs / err" for n, r in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for layout in layouts:
        cells = [" / ".join(results[c].get(layout, ("-", "-"))) for c in cols]
        print(f"| {layout} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
