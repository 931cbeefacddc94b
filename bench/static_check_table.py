"""The static check of the Triton family's default space as a markdown table: registers,
spills and shared memory of every distinct compiled variant (per-sequence splits and the
balanced schedules of length-bucket runners) on sm_90 and gfx950, from the
JSON lines `python -m mla_tune.tuning.triton_variants` prints (it cross-compiles on the CPU; no GPU).

    python -m mla_tune.tuning.triton_variants --jobs 2 | python3 bench/static_check_table.py
"""

from __future__ import annotations

import json
import sys

KNOBS = ("kv_format", "compute", "block_m", "block_n", "num_stages", "kv_load", "fp8_convert")


def table(lines: list[str]) -> str:
    """One row per variant, the two targets side by side; variants in the order given."""
    rows: dict[tuple, dict[str, dict]] = {}
    for line in lines:
        if line.strip():
            row = json.loads(line)
            key = (row.get("schedule", "splits"), *(row["config"][k] for k in KNOBS))
            rows.setdefault(key, {})[row["report"]["target"]] = row["report"]

    def cell(rep: dict | None, spill_unit: str) -> str:
        if rep is None:
            return "-"
        if not rep["ok"]:
            return f"failed: {rep['error'][:60]}"
        return f"{rep['registers']} / {rep['spills']}{spill_unit} / {rep['shared']}"

    out = ["| schedule | kv format | compute | block_m | block_n | stages | kv_load | fp8_convert "
           "| sm_90: registers / spills / shared B | gfx950: registers / spills / shared B |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for key, reps in rows.items():
        out.append("| " + " | ".join(map(str, key)) + f" | {cell(reps.get('cuda:90'), ' B')} "
                   f"| {cell(reps.get('hip:gfx950'), '')} |")
    spilled = sum(1 for reps in rows.values() for r in reps.values() if r["ok"] and r["spills"])
    out.append("")
    out.append(f"{len(rows)} variants; {spilled} (variant, target) reports with spills.")
    return "\n".join(out)


if __name__ == "__main__":
    print(table(sys.stdin.read().splitlines()))
