"""Where the sm_90 static check's spills sit: for every variant of the Triton family's default
space that spills on sm_90 (per-sequence splits and the balanced schedules of length-bucket
runners), the spill instructions (local loads and stores) in its SASS and how many lie
inside the tile loop (`static_check.spill_sites`). A spill outside the tile loop runs once
per program or sequence; one inside it runs once per KV tile. Cross-compiles on the CPU,
no GPU:

    python3 bench/spill_sites.py
"""

from __future__ import annotations

import sys

import benchkit  # noqa: F401 - refuses to run against another checkout
from mla_tune.kernels.triton import mla_decode as md
from mla_tune.kernels.triton import static_check as sc
from mla_tune.tuning.triton_variants import balanced_variants, default_variants

TARGET = "cuda:90"


def main() -> int:
    variants = [(c, md.SCHED_SPLITS) for c in default_variants()] + balanced_variants()
    print("| schedule | kv format | compute | block_m | block_n | stages | kv_load | "
          "fp8_convert | registers / spill B | spill instructions | in the tile loop |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    clean = 0
    for cfg, sched in variants:
        rep = sc.compile_variant(cfg, TARGET, sched=sched)
        if not rep.ok or not rep.spills:
            clean += rep.ok
            continue
        k = sc.compile_split(cfg, TARGET, sched=sched)
        total, hot = sc.spill_sites(k.asm["cubin"])
        print(f"| {sc.SCHEDULE_NAMES[sched]} | {cfg.kv_format} | {cfg.compute} | {cfg.block_m} | "
              f"{cfg.block_n} | {cfg.num_stages} | {cfg.kv_load} | {cfg.fp8_convert} | "
              f"{rep.registers} / {rep.spills} | {total} | {hot} |", flush=True)
    print(f"\n{len(variants)} variants, {clean} without spills on {TARGET}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
