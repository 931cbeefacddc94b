"""The bench scripts import each other and `benchkit` as top-level modules, as they do when
run as `python3 bench/NAME.py`: these tests put bench/ on the path the same way."""

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
