"""What a Triton MLA decode variant compiles to, without a GPU: cross-compile chosen
variants for sm_90 and count, per thread, the instructions of the KV-tile loop in the PTX
(MMAs, shared-memory traffic, conversions, async copies, barriers), next to the registers,
spills and shared memory the static check records. A dev script for kernel work: it shows
whether an edit did what it meant (one conversion per value, vector stores, wgmma instead of
mma.sync) before any device time is spent.

    python3 bench/kernel_ptx_stats.py VARIANT [VARIANT ...] [--heads 16] [--dump DIR]
        [--sched splits|tokens|paged] [--sass]

Variants use bench/kernel_probe.py's syntax (`format:BxKV:knobs`, `benchkit.parse_variant`;
the shape is ignored), so the same strings can be compiled here and timed there. `--sched`
compiles the split kernel of a length bucket's runner instead (the balanced schedule over
a contiguous cache or a page pool of the variant's `page_size`); `--sass` also counts the
tile loop's SASS instructions (nvdisasm of the cubin: the loop around the MMAs), where
address arithmetic and table loads show that the PTX leaves to ptxas.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

import benchkit
from mla_tune.kernels.triton import mla_decode as md
from mla_tune.kernels.triton.static_check import compile_split, usage

SCHEDS = {"splits": md.SCHED_SPLITS, "tokens": md.SCHED_TOKENS, "paged": md.SCHED_PAGED}
SASS_SHOWN = ("LDG", "LDGSTS", "IMAD", "SHF", "LEA", "LOP3", "LDL", "STL")

COUNTED = ("mma.sync", "wgmma.mma_async", "ldmatrix", "ld.shared", "ld.shared.v4",
           "ld.shared.b8", "st.shared.b8", "st.shared.b16", "st.shared.b32", "st.shared.v2",
           "st.shared.v4", "cp.async.cg", "cp.async.ca", "ld.global", "cvt.", "prmt", "lop3",
           "mul.rn.bf16x2", "ex2", "bar.sync")


def tile_loop(ptx: str) -> str:
    """The PTX of the KV-tile loop: from the branch into a loop header LLVM marks 'Inner
    Loop Header' to the loop's exit block, so blocks laid out before the header (the latch)
    are included; the first such loop holding MMAs (a chunked bucket runner's search loop
    comes first and holds none). Empty when the kernel has no such loop."""
    lines = ptx.split("\n")
    loops = []
    for head in (i for i, line in enumerate(lines) if "Inner Loop Header" in line):
        label = lines[head].split(":")[0].strip()
        entries = [i for i, line in enumerate(lines)
                   if "bra" in line and line.strip().endswith(label + ";") and i < head]
        exits = [i for i, line in enumerate(lines) if i > head and "crit_edge" in line]
        loops.append("\n".join(lines[entries[0] if entries else head:
                                      exits[0] if exits else len(lines)]))
    return next((loop for loop in loops if "mma" in loop), loops[0] if loops else "")


def stats(kernel) -> dict[str, int]:
    """Resources and tile-loop instruction counts (per thread) of a compiled kernel."""
    regs, spills = usage(kernel, "cuda:90")
    loop = tile_loop(kernel.asm["ptx"])
    out = {"regs": regs, "spill_bytes": spills, "smem": int(kernel.metadata.shared)}
    out.update({name: len(re.findall(re.escape(name), loop)) for name in COUNTED})
    return out


def sass_tile_loop(cubin: bytes, nvdisasm: str) -> collections.Counter:
    """Opcode counts of the tile loop in a cubin's SASS: the innermost loop (a backward
    branch to a label) holding matrix instructions (GMMA or HMMA); empty without one."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", "-g", f.name], capture_output=True, text=True,
                              check=True).stdout
    ops: list[str] = []  # opcode of each instruction, predicate and modifiers dropped
    branches: list[tuple[int, str]] = []  # (instruction index, target label)
    label_at: dict[str, int] = {}
    for line in sass.split("\n"):
        m = re.match(r"\s*\.(L_x_\d+):", line)
        if m:
            label_at[m.group(1)] = len(ops)
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            target = re.search(r"BRA\s+`?\(?\.(L_x_\d+)", m.group(1))
            if target:
                branches.append((len(ops), target.group(1)))
            ops.append(re.sub(r"^@!?U?P\w+\s+", "", m.group(1)).split(" ")[0].split(".")[0])
    loops = []
    for i, label in branches:
        start = label_at.get(label, i + 1)
        if start <= i:
            body = collections.Counter(ops[start:i + 1])
            if any(op.endswith("GMMA") or op == "HMMA" for op in body):
                loops.append(body)
    return min(loops, key=lambda b: sum(b.values())) if loops else collections.Counter()


def nvdisasm_path() -> str:
    """Triton's bundled nvdisasm (no CUDA toolkit needed)."""
    import triton.backends.nvidia as nv

    return str(Path(nv.__file__).parent / "bin" / "nvdisasm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dump", type=Path, help="also write each variant's PTX and TTGIR here")
    ap.add_argument("--sched", choices=sorted(SCHEDS), default="splits",
                    help="the split kernel of per-sequence splits (default) or of a length "
                         "bucket's runner over a contiguous cache (tokens) or a page pool")
    ap.add_argument("--sass", action="store_true",
                    help="also count the tile loop's SASS instructions")
    a = ap.parse_args()
    for text in a.variants:
        kernel = compile_split(benchkit.parse_variant(text)[1], "cuda:90", a.heads,
                               SCHEDS[a.sched])
        nonzero = " ".join(f"{k}={v}" for k, v in stats(kernel).items() if v)
        print(f"{text}\n    {nonzero}", flush=True)
        if a.sass:
            ops = sass_tile_loop(kernel.asm["cubin"], nvdisasm_path())
            shown = " ".join(f"{k}={ops[k]}" for k in SASS_SHOWN)
            print(f"    SASS tile loop: {sum(ops.values())} instructions, {shown}", flush=True)
        if a.dump:
            a.dump.mkdir(parents=True, exist_ok=True)
            stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", text)
            (a.dump / f"{stem}.ptx").write_text(kernel.asm["ptx"])
            (a.dump / f"{stem}.ttgir").write_text(kernel.asm["ttgir"])


if __name__ == "__main__":
    main()
