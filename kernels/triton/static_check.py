"""Compile kernel variants for a GPU target without a GPU and read their resource use.

Lets CI prove every variant of the default space builds for NVIDIA sm_90 and AMD gfx950,
and lets the tuner skip variants that spill registers or do not fit in shared memory
before spending device time. Results are cached on disk keyed by kernel source, constexprs,
options and target, since compiling takes seconds per variant.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from kernels.triton import mla_decode as md

CACHE_DIR = Path(os.environ.get("MLA_TUNE_CACHE", Path.home() / ".cache" / "mla-tune")) / "static"

TARGETS = {
    "cuda:90": ("cuda", 90, 32),
    "hip:gfx950": ("hip", "gfx950", 64),
}
SHARED_LIMIT = {"cuda:90": 232448, "hip:gfx950": 163840}
"""Max dynamic shared memory per block: H100/H200 227 KiB; MI355X (gfx950) 160 KiB LDS."""

VGPR_LIMIT = {"hip:gfx950": 512}
"""Architectural VGPRs (+AGPRs) per wave on CDNA3/4 at the lowest occupancy."""


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


_PTR = {"bf16": "*bf16", "fp8": "*fp8e4nv", "mxfp4": "*u8"}


def split_signature(kv_format: str) -> dict[str, str]:
    """Argument types of `mla_decode_kernel` as the launcher passes them."""
    return {
        "Q": "*bf16", "KV": _PTR[kv_format], "KV_SCALE": "*fp32", "KV_SC": "*u8",
        "sc_stride": "i32", "QO_INDPTR": "*i32", "KV_INDPTR": "*i32", "PAGE_TBL": "*i32",
        "PAGE_INDPTR": "*i32", "page_shift": "i32", "OUT": "*bf16", "PART_O": "*fp32",
        "PART_LSE": "*fp32", "COUNTERS": "*i32", "H": "i32", "total_rows": "i32",
        "n_splits": "i32", "qk_scale": "fp32", "fast": "i32",
    }


def _source_hash() -> str:
    return hashlib.sha256(Path(md.__file__).read_bytes()).hexdigest()[:16]


def variant_key(cfg: md.KernelConfig) -> tuple:
    """What distinguishes compiled split kernels: runtime knobs (split count, fast mode,
    the page size value) do not, only whether a page table is read."""
    return (cfg.kv_format, cfg.compute, cfg.block_m, cfg.block_n, cfg.num_warps,
            cfg.num_stages, cfg.page_size > 1)


def _cache_path(key: tuple, target: str) -> Path:
    text = json.dumps([_source_hash(), list(key), target])
    return CACHE_DIR / (hashlib.sha256(text.encode()).hexdigest()[:24] + ".json")


def _cubin_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, local-memory bytes per thread) of the compiled cubin, read with the
    cuobjdump bundled with Triton (no second ptxas run). Local memory in these kernels
    only comes from register spills."""
    from triton import knobs

    tool = Path(knobs.nvidia.ptxas.path).with_name("cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "k.cubin"
        f.write_bytes(cubin)
        res = subprocess.run([str(tool), "--dump-resource-usage", str(f)],
                             capture_output=True, text=True)
    text = res.stdout + res.stderr
    regs = re.search(r"REG:(\d+)", text)
    local = re.search(r"LOCAL:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    if regs is None:
        raise RuntimeError(f"cuobjdump gave no resource usage: {text[:200]}")
    return int(regs.group(1)), int(local.group(1) if local else 0) + int(
        stack.group(1) if stack else 0)


def _amdgcn_usage(asm: str) -> tuple[int, int]:
    """(VGPRs incl. AGPRs, spill count) from the AMDGCN metadata text."""
    def field(name: str) -> int:
        m = re.search(rf"\.{name}:\s+(\d+)", asm)
        return int(m.group(1)) if m else 0
    vgpr = field("vgpr_count")
    agpr = field("agpr_count")
    spill = field("vgpr_spill_count") + field("sgpr_spill_count")
    return vgpr + agpr, spill


def compile_variant(cfg: md.KernelConfig, target: str, use_cache: bool = True) -> CompileReport:
    """Cross-compile the split kernel of `cfg` for `target` ('cuda:90' or 'hip:gfx950')."""
    import time

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    key = variant_key(cfg)
    path = _cache_path(key, target)
    if use_cache and path.exists():
        return CompileReport(**json.loads(path.read_text()))
    sig = split_signature(cfg.kv_format)
    consts = cfg.constexprs(paged=cfg.page_size > 1, upcast=False)
    fn = md.mla_decode_kernel
    for name in consts:
        sig[name] = "constexpr"
    # As the JIT specializes a launch: tensors 16-byte aligned, H a multiple of 16 (the
    # other integers are declared do_not_specialize).
    aligned = [n for n, t in sig.items() if t.startswith("*")] + ["H"]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    t0 = time.time()
    try:
        src = ASTSource(fn, sig, consts, attrs)
        k = triton.compile(src, target=GPUTarget(*TARGETS[target]),
                           options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        if target.startswith("cuda"):
            regs, spills = _cubin_usage(k.asm["cubin"])
        else:
            regs, spills = _amdgcn_usage(k.asm["amdgcn"])
        rep = CompileReport(target, True, regs, spills, int(k.metadata.shared),
                            seconds=round(time.time() - t0, 2))
    except Exception as e:  # a variant that does not compile is a result, not a crash
        import traceback

        where = traceback.extract_tb(e.__traceback__)[-1]
        msg = str(e).strip().splitlines()
        text = f"{type(e).__name__}: {msg[-1] if msg else ''} ({where.filename}:{where.lineno})"
        rep = CompileReport(target, False, error=text[:400], seconds=round(time.time() - t0, 2))
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(rep)))
    return rep


def check(cfg: md.KernelConfig, targets: list[str]) -> str | None:
    """First problem of `cfg` on any of `targets`, or None when it compiles cleanly."""
    for t in targets:
        problem = compile_variant(cfg, t).problem()
        if problem:
            return problem
    return None


def default_variants() -> list[md.KernelConfig]:
    """Distinct compiled split kernels of the declared default space, over all formats.
    Runtime knobs (splits, fast mode, page size) are folded away."""
    from mla_tune.backends.triton_family import TritonFamily
    from mla_tune.problem import KVFormat, Shape
    from mla_tune.space import load_backend_space

    fam = TritonFamily()
    seen: dict[tuple, md.KernelConfig] = {}
    for fmt in KVFormat:
        # A shape on which every block size is meaningful (128 rows, long sequences).
        shape = Shape.uniform(1, 8192, q_len=4, heads=32, kv_format=fmt)
        for point in load_backend_space("triton", "cuda").grid():
            point = dict(point, num_splits=1)
            if not fam.feasible(shape, point):
                continue
            cfg = md.KernelConfig(kv_format=fmt.value, compute=str(point["compute"]),
                                  block_m=int(point["block_m"]), block_n=int(point["block_n"]),
                                  num_warps=int(point["num_warps"]),
                                  num_stages=int(point["num_stages"]),
                                  page_size=int(point["page_size"]))
            seen.setdefault(variant_key(cfg), cfg)
    return list(seen.values())


def _job(job: tuple[md.KernelConfig, str]) -> dict:
    cfg, target = job
    return {"config": asdict(cfg), "report": asdict(compile_variant(cfg, target))}


def main(argv: list[str] | None = None) -> int:
    """Compile every default-space variant for both targets; one JSON line per report.
    Exit status 1 if any variant fails to compile."""
    import argparse
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    a = ap.parse_args(argv)
    jobs = [(cfg, t) for cfg in default_variants() for t in TARGETS]
    failed = 0
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max(1, a.jobs), mp_context=ctx) as ex:
        for row in ex.map(_job, jobs):
            failed += not row["report"]["ok"]
            print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
