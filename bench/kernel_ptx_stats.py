"""What a Triton MLA decode variant compiles to, without a GPU: cross-compile chosen
variants for sm_90 and count, per thread, the instructions of the KV-tile loop in the PTX
(MMAs, shared-memory traffic, conversions, async copies, barriers), next to the registers,
spills and shared memory the static check records. A dev script for kernel work: it shows
whether an edit did what it meant (one conversion per value, vector stores, wgmma instead of
mma.sync) before any device time is spent.

    python3 bench/kernel_ptx_stats.py VARIANT [VARIANT ...] [--heads 16] [--dump DIR]

Variants use bench/kernel_probe.py's syntax (`format:BxKV:knobs`, `benchkit.parse_variant`;
the shape is ignored), so the same strings can be compiled here and timed there.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import benchkit
from mla_tune.kernels.triton.static_check import compile_split, usage

COUNTED = ("mma.sync", "wgmma.mma_async", "ldmatrix", "ld.shared", "ld.shared.v4",
           "ld.shared.b8", "st.shared.b8", "st.shared.b16", "st.shared.b32", "st.shared.v2",
           "st.shared.v4", "cp.async.cg", "cp.async.ca", "ld.global", "cvt.", "prmt", "lop3",
           "mul.rn.bf16x2", "ex2", "bar.sync")


def tile_loop(ptx: str) -> str:
    """The PTX of the KV-tile loop: from the branch into the loop header LLVM marks
    'Inner Loop Header' to the loop's exit block, so blocks laid out before the header
    (the latch) are included. Empty when the kernel has no such loop."""
    lines = ptx.split("\n")
    heads = [i for i, line in enumerate(lines) if "Inner Loop Header" in line]
    if not heads:
        return ""
    head = heads[0]
    label = lines[head].split(":")[0].strip()
    entries = [i for i, line in enumerate(lines)
               if "bra" in line and line.strip().endswith(label + ";") and i < head]
    start = entries[0] if entries else head
    exits = [i for i, line in enumerate(lines) if i > head and "crit_edge" in line]
    end = exits[0] if exits else len(lines)
    return "\n".join(lines[start:end])


def stats(kernel) -> dict[str, int]:
    """Resources and tile-loop instruction counts (per thread) of a compiled kernel."""
    regs, spills = usage(kernel, "cuda:90")
    loop = tile_loop(kernel.asm["ptx"])
    out = {"regs": regs, "spill_bytes": spills, "smem": int(kernel.metadata.shared)}
    out.update({name: len(re.findall(re.escape(name), loop)) for name in COUNTED})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dump", type=Path, help="also write each variant's PTX and TTGIR here")
    a = ap.parse_args()
    for text in a.variants:
        kernel = compile_split(benchkit.parse_variant(text)[1], "cuda:90", a.heads)
        nonzero = " ".join(f"{k}={v}" for k, v in stats(kernel).items() if v)
        print(f"{text}\n    {nonzero}", flush=True)
        if a.dump:
            a.dump.mkdir(parents=True, exist_ok=True)
            stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", text)
            (a.dump / f"{stem}.ptx").write_text(kernel.asm["ptx"])
            (a.dump / f"{stem}.ttgir").write_text(kernel.asm["ttgir"])


if __name__ == "__main__":
    main()
