"""The Triton MLA decode kernel with probes patched in, for the dev scripts that look inside a
split program (bench/kernel_phases.py, bench/program_timeline.py).

Every split program gets DEBUG_WORDS int64 words of a debug buffer: `dbg` in the kernel's
per-sequence split path (SCHED_SPLITS, the one MlaDecodeLauncher runs; the balanced
schedules are not probed) and in `_attend_rows`, which that path calls once per program;
`launcher.dbg` on the host. A script adds its own patches (its probes) on top. Each patch
point must occur exactly once, so a kernel change that moves one fails loudly.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import benchkit

DEBUG_WORDS = 8
"""int64 words of the debug buffer per split program."""

Patch = tuple[str, str]

_DEBUG_BUFFER: list[Patch] = [
    ("    OUT, PART_O, PART_LSE, COUNTERS,\n    H, total_rows,",
     "    OUT, PART_O, PART_LSE, COUNTERS, DBG,\n    H, total_rows,"),
    ("    if SCHED == 0:\n        b = tl.program_id(2)\n",
     "    if SCHED == 0:\n        b = tl.program_id(2)\n"
     f"        dbg = DBG + ((b * tl.num_programs(1) + split) * tl.num_programs(0) + pid_m) * "
     f"{DEBUG_WORDS}\n"),
    ("def _attend_rows(\n    Q, KV,", "def _attend_rows(\n    dbg, Q, KV,"),
    ("            _attend_rows(\n                Q, KV,",
     "            _attend_rows(\n                dbg, Q, KV,"),
    ('''0, torch.bfloat16, f32, f32, i32, heads,''',
     '''0, torch.bfloat16, f32, f32, i32, torch.int64, heads,'''),
    ('''                      self.part_lse, self.counters, self.heads,''',
     '''                      self.part_lse, self.counters, self.dbg, self.heads,'''),
    ('''dtype=torch.int32,
                                    device=device)
        self.dummy_f32 = torch.zeros(1, dtype=torch.float32, device=device)''',
     '''dtype=torch.int32,
                                    device=device)
        self.dummy_f32 = torch.zeros(1, dtype=torch.float32, device=device)
        self.dbg = torch.zeros(%d * self.batch * self.row_blocks * self.n_splits,
                               dtype=torch.int64, device=device)''' % DEBUG_WORDS),
]
"""Threads the debug buffer through the split kernel (its SCHED_SPLITS path), `_attend_rows`
and the launcher."""


_READ_WIDTHS = {64: ("u64", "l", "tl.int64"), 32: ("u32", "r", "tl.int32")}


def register_readers(readers: dict[str, tuple[str, int]]) -> Patch:
    """A patch defining, before _mma_operand, one jit function per `name: (register, bits)`
    that reads PTX special register `%register` (e.g. `globaltimer`, 64) once its argument
    is computed (the argument orders the read after the value it follows)."""
    defs = []
    for name, (register, bits) in readers.items():
        ptx_type, constraint, dtype = _READ_WIDTHS[bits]
        defs.append(
            f"@triton.jit\ndef {name}(dep):\n"
            f"    return tl.inline_asm_elementwise(\"mov.{ptx_type} $0, %{register}; // $1\", "
            f"\"={constraint},r\",\n"
            f"                                     [dep.to(tl.int32)], dtype={dtype}, "
            "is_pure=False,\n                                     pack=1)\n\n\n")
    anchor = "@triton.jit\ndef _mma_operand("
    return anchor, "".join(defs) + anchor


def at_program_start(stmt: str) -> Patch:
    """A patch running `stmt` (one line) first thing in every split program, once its
    program ids are read and before its debug words are addressed (a probe of the
    program's start; kernel scope, so `at_program_end` can store what it computed)."""
    anchor = "\n        dbg = DBG + ((b"
    return anchor, f"\n        {stmt}{anchor}"


def at_loop_end(stmt: str) -> Patch:
    """A patch running `stmt` (one line) once a bf16/fp8 program's KV loop is done and its
    softmax state `l_i` is final, before the epilogue (in `_attend_rows`)."""
    anchor = "\n    l_safe = tl.where(l_i > 0, l_i, 1.0)\n"
    return anchor, f"\n    {stmt}{anchor}"


_PROGRAM_END = "                NV_ASM, TMA, SCHED)\n"
"""The end of the SCHED_SPLITS path's `_attend_rows` call, inside its active-program branch."""
_OTHER_SCHEDULES = "    elif CHUNKS:\n"
"""What follows the SCHED_SPLITS path (the balanced schedules' branches)."""


def at_program_end(stmts: Sequence[str]) -> Patch:
    """A patch running `stmts` (one line each) after a split program's last statement (its
    output, partial or fused merge stored: `_attend_rows` returned), behind a barrier so
    every warp is done. Only programs with rows and keys to attend get there."""
    body = "".join(f"            {s}\n" for s in ["tl.debug_barrier()", *stmts])
    return _PROGRAM_END + _OTHER_SCHEDULES, _PROGRAM_END + body + _OTHER_SCHEDULES


def apply_patches(src: str, patches: Sequence[Patch]) -> str:
    """`src` with each (old, new) patch applied in order; each `old` must occur exactly once
    (a kernel change that moves a patch point stops the script)."""
    for old, new in patches:
        if src.count(old) != 1:
            raise SystemExit(f"the kernel changed: patch point not found once:\n{old[:200]}")
        src = src.replace(old, new)
    return src


def probed_module(patches: Sequence[Patch], name: str) -> ModuleType:
    """kernels/triton/mla_decode.py with the debug buffer and `patches` applied in order,
    imported from a temporary file `name`.py."""
    src = apply_patches((benchkit.ROOT / "kernels" / "triton" / "mla_decode.py").read_text(),
                        [*_DEBUG_BUFFER, *patches])
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(src)
    return benchkit.load_kernel(path)


def probed_launcher(md: ModuleType, text: str, heads: int = 16
                    ) -> tuple[Any, Callable[[], Any]]:
    """The launcher of variant `text` (kernel_probe's syntax) from probed module `md`,
    compiled, and a call of it on the task's inputs."""
    shape, cfg = benchkit.parse_variant(text, heads)
    data = benchkit.task_input(shape)
    args = benchkit.launcher_args(data, shape.kv_format)
    launcher = benchkit.prepared_launcher(md, cfg, shape, data)
    return launcher, lambda: launcher(*args)


@functools.cache
def _cold_timer() -> Any:
    """One timer for all variants: its L2-flush buffer is allocated once."""
    import torch

    from mla_tune.tuning.timing import CudaTimer

    return CudaTimer(torch.device("cuda"))


def debug_rows(launcher: Any, call: Callable[[], Any], launches: int = 10,
               warmup: int = 2) -> list[Any]:
    """The debug buffer after each of `launches` cold-L2 calls (the timer's flush before
    each), as [programs, DEBUG_WORDS] int64 CPU tensors; `warmup` calls before them load
    modules and warm clocks."""
    import torch

    rows = []
    for it in range(warmup + launches):
        _cold_timer().flush_l2()
        launcher.dbg.zero_()
        call()
        torch.cuda.synchronize()
        if it >= warmup:
            rows.append(launcher.dbg.view(-1, DEBUG_WORDS).cpu())
    return rows
