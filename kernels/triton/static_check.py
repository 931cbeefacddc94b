"""Compile kernel variants for a GPU target without a GPU and read their resource use.

Lets CI prove every variant of the default space builds for NVIDIA sm_90 and AMD gfx950,
and lets the tuner skip variants that spill registers or do not fit in shared memory
before spending device time. Results are cached on disk keyed by kernel source, Triton
version, constexprs, options and target, since compiling takes seconds per variant. Several
processes (`--gpus N`, concurrent sweeps) share the cache: entries are written atomically
and an unreadable one is recompiled.

Which variants exist is the tuner's business: `python -m mla_tune.tuning.triton_variants`
enumerates the Triton family's default space and compiles it with `compile_all`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from . import mla_decode as md
from .precompile import TARGETS, jit_compile

SHARED_LIMIT = {"cuda:90": 232448, "hip:gfx950": 163840}
"""Max dynamic shared memory per block: H100/H200 227 KiB; MI355X (gfx950) 160 KiB LDS."""

SCHEDULE_NAMES = {md.SCHED_SPLITS: "splits", md.SCHED_TOKENS: "tokens", md.SCHED_PAGED: "paged"}
"""The split kernel's schedules (mla_decode.py): per-sequence splits (exact shapes), and the
balanced schedules of length-bucket runners over a contiguous cache or a page pool."""

BALANCED_BATCH_P2 = 256
"""The batch bound a BalancedLauncher compiles its kernels for up to 256 sequences: one
compiled kernel serves every such batch."""


def balanced_config(cfg: md.KernelConfig, sched: int) -> md.KernelConfig:
    """`cfg` as a BalancedLauncher runs it under `sched`: 'tma_host' runs as per-program
    descriptors ('tma'); a page pool of `cfg.page_size`-key pages is read as
    mla_decode.paged_form says (TMA, or pointer loads through a page index per key or per
    tile). (tests/kernels/test_static_check.py checks this against BalancedLauncher
    itself.)"""
    if sched == md.SCHED_PAGED:
        return md.paged_form(cfg, cfg.page_size)
    return replace(cfg, kv_load="tma" if cfg.kv_load == "tma_host" else cfg.kv_load,
                   page_rows="key")


def _launch_form(cfg: md.KernelConfig, sched: int) -> tuple[md.KernelConfig, bool | int, int]:
    """(config, page-table flag, batch bound) of the kernels a launcher of `cfg` compiles
    under `sched`."""
    if sched == md.SCHED_SPLITS:
        return cfg, cfg.page_size > 1, 1
    c = balanced_config(cfg, sched)
    return c, md.paged_flag(c) if sched == md.SCHED_PAGED else False, BALANCED_BATCH_P2


@dataclass(frozen=True)
class CompileReport:
    """Resources of one compiled variant on one target."""

    target: str
    ok: bool
    registers: int = 0
    spills: int = 0
    shared: int = 0
    error: str = ""
    seconds: float = 0.0

    def problem(self) -> str | None:
        """Why this variant should not run (compile error, spills, shared overflow)."""
        if not self.ok:
            return f"{self.target}: does not compile: {self.error}"
        if self.spills:
            return f"{self.target}: spills {self.spills} (registers {self.registers})"
        if self.shared > SHARED_LIMIT.get(self.target, 1 << 30):
            return f"{self.target}: shared memory {self.shared} B over {SHARED_LIMIT[self.target]}"
        return None


def _source_hash() -> str:
    return hashlib.sha256(Path(md.__file__).read_bytes()).hexdigest()[:16]


def variant_key(cfg: md.KernelConfig) -> tuple:
    """What distinguishes compiled kernels: runtime knobs (split count, fast mode, the page
    size value) do not, only whether a page table is read (and, by a balanced runner, a
    page index per key or per tile, and runs along the stream or in chunks)."""
    return (cfg.kv_format, cfg.compute, cfg.block_m, cfg.block_n, cfg.num_warps,
            cfg.num_stages, cfg.page_size > 1, cfg.fp8_convert,
            cfg.kv_load if cfg.tma() else "pointer", cfg.pdl, cfg.page_rows, cfg.bucket_runs)


def compiled_key(cfg: md.KernelConfig, heads: int = 16,
                 sched: int = md.SCHED_SPLITS) -> tuple:
    """What distinguishes compiled kernels of a launch with `heads` query heads: the
    variant, whether `heads` is a multiple of 16 (Triton specializes on it), and a
    balanced schedule's kind."""
    if sched == md.SCHED_SPLITS:
        return (*variant_key(cfg), heads % 16 == 0)
    return (*variant_key(balanced_config(cfg, sched)), heads % 16 == 0, sched)


def cache_dir() -> Path:
    """Where reports are cached: `$MLA_TUNE_CACHE/static` (default ~/.cache/mla-tune)."""
    root = os.environ.get("MLA_TUNE_CACHE") or Path.home() / ".cache" / "mla-tune"
    return Path(root) / "static"


def _cache_path(key: tuple, target: str) -> Path:
    import triton

    # The Triton version is part of the key: a compiler upgrade changes register use.
    text = json.dumps([_source_hash(), triton.__version__, list(key), target])
    return cache_dir() / (hashlib.sha256(text.encode()).hexdigest()[:24] + ".json")


def _read_cache(path: Path, target: str) -> CompileReport | None:
    """The cached report at `path`, or None when there is none or it is unreadable (a
    corrupt or foreign file is a miss, recompiled and rewritten, never an error)."""
    try:
        rep = CompileReport(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return rep if rep.target == target else None


def _write_cache(path: Path, rep: CompileReport) -> None:
    """Store `rep` at `path` atomically: written to a temporary file in the same folder,
    then renamed over `path`, so a concurrent reader sees the old file or the new one,
    never a partial one. A cache that cannot be written is only a lost speed-up."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.stem + ".",
                                         suffix=".tmp", delete=False) as f:
            tmp = f.name
            f.write(json.dumps(asdict(rep)))
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _run_on_cubin(tool: Path, flag: str, cubin: bytes) -> subprocess.CompletedProcess[str]:
    """Run one of the CUDA binary tools bundled with Triton on `cubin` (written to a
    temporary file), output captured as text."""
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "k.cubin"
        f.write_bytes(cubin)
        return subprocess.run([str(tool), flag, str(f)], capture_output=True, text=True)


def _cubin_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, local-memory bytes per thread) of the compiled cubin, read with the
    cuobjdump bundled with Triton (no second ptxas run). Local memory in these kernels
    only comes from register spills."""
    from triton import knobs

    res = _run_on_cubin(Path(knobs.nvidia.ptxas.path).with_name("cuobjdump"),
                        "--dump-resource-usage", cubin)
    text = res.stdout + res.stderr
    regs = re.search(r"REG:(\d+)", text)
    local = re.search(r"LOCAL:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    if regs is None:
        raise RuntimeError(f"cuobjdump gave no resource usage: {text[:200]}")
    return int(regs.group(1)), int(local.group(1) if local else 0) + int(
        stack.group(1) if stack else 0)


_MMA = re.compile(r"\b[HQI]?GMMA\b|\bHMMA\b|\bIMMA\b")
_SPILL = re.compile(r"\b(LDL|STL)\b")


def spill_sites(cubin: bytes) -> tuple[int, int]:
    """(spill instructions in the kernel, those inside its tile loops): local-memory loads
    and stores in the SASS, and how many of them lie inside an innermost loop that issues
    matrix instructions, which runs once per KV tile. Spills outside it run once per
    program or per sequence, a cost next to nothing beside the tiles' (the balanced
    schedule's spills sit there: bench/results/static_check.md). NVIDIA cubins, read
    with the nvdisasm bundled with Triton."""
    from triton import knobs

    res = _run_on_cubin(Path(knobs.nvidia.nvdisasm.path), "-c", cubin)
    if res.returncode:
        raise RuntimeError(f"nvdisasm failed: {res.stderr[:200]}")
    lines = res.stdout.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"\s*\.(L_x_\d+):", line))}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"\bBRA\b[^;]*`\(\.(L_x_\d+)\)", line))
             and labels.get(m.group(1), i) < i]
    mma_loops = [(a, b) for a, b in loops if any(_MMA.search(x) for x in lines[a:b])]
    tile_loops = [(a, b) for a, b in mma_loops
                  if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in mma_loops)]
    spills = [i for i, line in enumerate(lines) if _SPILL.search(line)]
    hot = sum(any(a <= i <= b for a, b in tile_loops) for i in spills)
    return len(spills), hot


def _amdgcn_usage(asm: str) -> tuple[int, int]:
    """(VGPRs incl. AGPRs, spill count) from the AMDGCN metadata text."""
    def field(name: str) -> int:
        m = re.search(rf"\.{name}:\s+(\d+)", asm)
        return int(m.group(1)) if m else 0
    vgpr = field("vgpr_count")
    agpr = field("agpr_count")
    spill = field("vgpr_spill_count") + field("sgpr_spill_count")
    return vgpr + agpr, spill


def compile_split(cfg: md.KernelConfig, target: str, heads: int = 16,
                  sched: int = md.SCHED_SPLITS) -> Any:
    """The split kernel of `cfg` compiled for `target`, as a launch with `heads` query heads
    under `sched` compiles it (the entry of Triton's cache that launch loads)."""
    c, paged, batch_p2 = _launch_form(cfg, sched)
    fn, args, kwargs = md.kernel_launches(c, heads=heads, paged=paged, merge=False,
                                          target=target, sched=sched, batch_p2=batch_p2)[0]
    return jit_compile(fn, target, args, kwargs)


def usage(kernel: Any, target: str) -> tuple[int, int]:
    """(registers per thread, spills) of a kernel compiled for `target`: local-memory bytes
    from the cubin on NVIDIA, the compiler's spill count on AMD."""
    if target.startswith("cuda"):
        return _cubin_usage(kernel.asm["cubin"])
    return _amdgcn_usage(kernel.asm["amdgcn"])


def compile_variant(cfg: md.KernelConfig, target: str, use_cache: bool = True,
                    heads: int = 16, sched: int = md.SCHED_SPLITS) -> CompileReport:
    """Cross-compile the split kernel of `cfg` for `target` ('cuda:90' or 'hip:gfx950'),
    specialized as a launch with `heads` query heads under `sched` is. The compile lands
    in Triton's cache under the key the launcher looks up, so checking a variant also
    compiles it ahead for the GPU that runs it."""
    import time

    path = _cache_path(compiled_key(cfg, heads, sched), target)
    if use_cache and (cached := _read_cache(path, target)) is not None:
        return cached
    t0 = time.time()
    try:
        k = compile_split(cfg, target, heads, sched)
        regs, spills = usage(k, target)
        rep = CompileReport(target, True, regs, spills, int(k.metadata.shared),
                            seconds=round(time.time() - t0, 2))
    except Exception as e:  # a variant that does not compile is a result, not a crash
        import traceback

        where = traceback.extract_tb(e.__traceback__)[-1]
        msg = str(e).strip().splitlines()
        text = f"{type(e).__name__}: {msg[-1] if msg else ''} ({where.filename}:{where.lineno})"
        rep = CompileReport(target, False, error=text[:400], seconds=round(time.time() - t0, 2))
    if use_cache:
        _write_cache(path, rep)
    return rep


def compile_ahead(cfg: md.KernelConfig, target: str, heads: int = 16,
                  sched: int = md.SCHED_SPLITS) -> str | None:
    """Compile every kernel a launcher of `cfg` may use under `sched` (split and merge
    kernels) into Triton's cache for `target`, and return the variant's static-check
    problem (None when it compiles cleanly). For a sweep's compile stage: GPU workers
    then only load."""
    problem = compile_variant(cfg, target, heads=heads, sched=sched).problem()
    if problem is not None:
        return problem
    c, paged, batch_p2 = _launch_form(cfg, sched)
    for fn, args, kwargs in md.kernel_launches(c, heads=heads, paged=paged, merge=True,
                                               target=target, sched=sched,
                                               batch_p2=batch_p2):
        jit_compile(fn, target, args, kwargs)  # a cache hit when just checked
    return None


def check(cfg: md.KernelConfig, targets: list[str], heads: int = 16,
          sched: int = md.SCHED_SPLITS) -> str | None:
    """First problem of `cfg` (under `sched`) on any of `targets`, or None when it
    compiles cleanly."""
    for t in targets:
        problem = compile_variant(cfg, t, heads=heads, sched=sched).problem()
        if problem:
            return problem
    return None


def _job(job: tuple[md.KernelConfig, str, int]) -> dict:
    cfg, target, sched = job
    return {"config": asdict(cfg), "schedule": SCHEDULE_NAMES[sched],
            "report": asdict(compile_variant(cfg, target, sched=sched))}


def compile_all(cfgs: Iterable[md.KernelConfig | tuple[md.KernelConfig, int]],
                targets: Iterable[str] = tuple(TARGETS), jobs: int = 2) -> Iterator[dict]:
    """Compile every config (or (config, schedule) pair; a bare config is per-sequence
    splits) for every target in `jobs` spawned worker processes; yields {"config": ...,
    "schedule": ..., "report": ...} rows (plain dicts) in order."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    pairs = [c if isinstance(c, tuple) else (c, md.SCHED_SPLITS) for c in cfgs]
    work = [(cfg, t, sched) for cfg, sched in pairs for t in targets]
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max(1, jobs), mp_context=ctx) as ex:
        yield from ex.map(_job, work)
