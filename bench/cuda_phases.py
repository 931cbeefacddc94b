"""Where a CUDA block's time goes (the `cuda_mma` and `cuda_wgmma` families): `%globaltimer`
stamps patched into a copy of the family's kernel at its phase boundaries (a dev script; the
kernels themselves carry no probes).

    python3 bench/cuda_phases.py bf16:4x1024:BN=64,MT=1,LOAD=0,QK=1,MERGE=0,SPLITS=16,CLUSTER=16
    python3 bench/cuda_phases.py --family cuda_wgmma fp8:256x8192:SPLITS=1

Each variant is built by the family's own code path from a family file that names the patched
copy (registered through $MLA_TUNE_BACKENDS as family `<family>_phases`), checked against the
float32 reference, then launched `--runs` times, each after the timer's L2 flush
(`CudaTimer.flush_l2`, the timing protocol's). Thread 0 of every block stamps each boundary it
passes and adds the time since its previous stamp to that phase's total, so a phase inside
the tile loop is counted over every tile. Printed per phase: the median over blocks and runs
of the time from the first block's start to the block's last pass of the boundary, of the
last pass's time since the previous stamp, and of the phase's total over all its passes
(µs), with the passes per block. A stamp waits for nothing, so work issued before it and
still in flight (an mma, a copy) is counted in the phase where it is waited for. A stamp
costs registers: a variant the probes make spill is reported and skipped.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

import benchkit
import probed_kernel

MAX_BLOCKS = 4096
PHASES = 16
"""Phases a kernel can be stamped with (phase indices 0 .. PHASES - 1)."""
SLOTS = 3 * PHASES
"""Per block: the last stamp of phase k (slot k), its total time (PHASES + k), its passes
(2 PHASES + k)."""


@dataclass(frozen=True)
class Family:
    """A CUDA family the script can stamp: its kernel, its family file, its anchors."""

    name: str
    source: Path
    anchors: list[tuple[int, str, str]]
    """(phase, name, text in the kernel with "@@" where the stamp goes); a phase may have
    several anchors: the branches of the macros a variant compiles."""

    @property
    def family_file(self) -> Path:
        return benchkit.ROOT / "configs" / "backends" / f"{self.name}.toml"

    @property
    def phases_name(self) -> str:
        """The registered name of the stamped copy."""
        return f"{self.name}_phases"

    def phase_names(self) -> dict[int, str]:
        """Phase index -> its name (the first anchor's)."""
        names: dict[int, str] = {}
        for phase, name, _ in self.anchors:
            names.setdefault(phase, name)
        return names


CUDA = benchkit.ROOT / "kernels" / "cuda"
FAMILIES = {
    "cuda_mma": Family("cuda_mma", CUDA / "mla_decode_mma.cu", [
        (0, "start", "if (have < SHARED_NEED) __trap();@@"),
        (1, "query in shared", "@@  // Rows g and g + 8 of the warp's tile"),
        (2, "tile ready", "    const uint8_t* kv_s = raw_s + buf * BN * RAW_STRIDE;\n@@"),
        (2, "tile ready",
         "    __syncthreads();\n    const uint8_t* kv_s = dec_s;\n@@#endif\n#else\n"),
        (2, "tile ready", "    if (tile + 1 < t_end) fetch(tile + 1);\n    __syncthreads();\n"
                          "    const uint8_t* kv_s = dec_s;\n@@"),
        (3, "scores", "@@    // Masked, scaled scores"),
        (4, "softmax, P stored", "@@    // O += P V for the warp's 128 columns"),
        (5, "P V", "    __syncthreads();  // the tile, P and the maxima are rewritten next "
                   "iteration\n@@"),
        (6, "row sums", "@@#if CLUSTER > 0\n  cluster_merge("),
        (7, "partials shared (barrier)", "@@  constexpr int COLS = DV / CLUSTER;"),
        (8, "columns merged", "@@  cluster.sync();  // no block leaves"),
        (9, "cluster done", "  cluster.sync();  // no block leaves while another still reads "
                            "its shared memory\n@@"),
        (7, "partial written", "@@  if (splits == 1 || !merge) return;"),
    ]),
    "cuda_wgmma": Family("cuda_wgmma", CUDA / "mla_decode_wgmma.cu", [
        (0, "start", "if (have < SHARED_NEED) __trap();@@"),
        (1, "query in shared", "// Q for the wgmma's reads\n  __syncthreads();\n@@"),
        (2, "tile ready", "    const uint8_t* raw = raw_s + buf * BN * RAW_STRIDE;\n@@"),
        (3, "scores (S^T waited for)", "@@    // Masked, scaled scores"),
        (4, "softmax, P stored", "@@\n#if KV_FORMAT == 1\n    value_product("),
        (5, "P V", "@@  }\n\n  // Row sums: over g, then the 4 warps."),
        (6, "row sums, output written", ": -INFINITY;\n    }\n  }\n@@}\n"),
    ]),
}

PROBE = """
__device__ unsigned long long mt_probes[{blocks} * {slots}];
// Thread 0's running totals (shared: the stamps of a cluster merge are in another function).
__shared__ unsigned long long mt_last_;
__shared__ unsigned mt_sum_[{phases}], mt_n_[{phases}];
#define MT_PROBE(k)                                                                     \\
  do {{                                                                                  \\
    if (threadIdx.x == 0) {{                                                             \\
      unsigned long long g_;                                                            \\
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g_));                            \\
      if ((k) == 0) {{                                                                   \\
        for (int i_ = 0; i_ < {phases}; ++i_) mt_sum_[i_] = mt_n_[i_] = 0u;             \\
      }} else {{                                                                         \\
        mt_sum_[k] += (unsigned)(g_ - mt_last_);                                        \\
      }}                                                                                 \\
      mt_n_[k] += 1u;                                                                   \\
      mt_last_ = g_;                                                                    \\
      const unsigned s_ = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x; \\
      if (s_ < {blocks}) {{                                                               \\
        unsigned long long* p_ = mt_probes + s_ * {slots};                              \\
        p_[k] = g_;                                                                     \\
        p_[{phases} + (k)] = mt_sum_[k];                                                \\
        p_[2 * {phases} + (k)] = mt_n_[k];                                              \\
      }}                                                                                 \\
    }}                                                                                   \\
  }} while (0)
"""


def patched_source(family: Family, text: str) -> str:
    """The kernel with a stamp at every anchor (each must occur exactly once) and the
    stamps' buffer and totals after its includes."""
    include = '#include "mla_common.cuh"\n'
    return probed_kernel.apply_patches(text, [
        *((a.replace("@@", ""), a.replace("@@", f"MT_PROBE({phase});\n"))
          for phase, _, a in family.anchors),
        (include, include + PROBE.format(blocks=MAX_BLOCKS, slots=SLOTS, phases=PHASES))])


def write_family(family: Family, where: Path) -> Path:
    """A copy of the family file naming the patched source; returns its path."""
    (where / family.source.name).write_text(patched_source(family, family.source.read_text()))
    (where / "mla_common.cuh").write_text((CUDA / "mla_common.cuh").read_text())
    path = where / f"{family.phases_name}.toml"
    path.write_text(family.family_file.read_text().replace("../../kernels/cuda/", ""))
    return path


def probe_buffer(run) -> tuple[object, int, int]:
    """(driver API, device address, bytes) of `mt_probes` in the module `run` launches (the
    build's closure holds its launches; a dev script may look)."""
    cells = [c.cell_contents for c in run.__closure__ or ()]
    launches = next(c for c in cells if isinstance(c, list) and c and hasattr(c[0], "module"))
    module = launches[0].module
    ptr, size = ctypes.c_uint64(), ctypes.c_size_t()
    module.api.call("ModuleGetGlobal_v2", ctypes.byref(ptr), ctypes.byref(size),
                    module.handle, b"mt_probes")
    return module.api, ptr.value, size.value


def stamps(api, ptr: int, size: int) -> list[list[int]]:
    """Per block, per slot (SLOTS): stamps in globaltimer ns, totals in ns, passes; 0 where
    nothing was written."""
    host = (ctypes.c_uint64 * (size // 8))()
    api.call("MemcpyDtoH_v2", host, ctypes.c_uint64(ptr), ctypes.c_size_t(size))
    vals = list(host)
    return [vals[b * SLOTS:(b + 1) * SLOTS] for b in range(MAX_BLOCKS)]


def profile(family: Family, text: str, runs: int, heads: int) -> None:
    from mla_tune.backends import get_backend
    from mla_tune.tuning.timing import CudaTimer

    dev = torch.device("cuda")
    backend = get_backend(family.phases_name)
    shape, config = benchkit.parse_int_knobs(text, heads)
    config = backend.declared_space(dev).validate(config)
    data = benchkit.task_input(shape, dev)
    try:
        run = backend.build(shape, config, dev)
    except RuntimeError as e:
        print(f"{text}  skipped: {e}", flush=True)
        return
    res = benchkit.check(run(data), benchkit.reference(data, shape.kv_format), shape.kv_format)
    api, ptr, size = probe_buffer(run)
    timer = CudaTimer(dev)
    since_start: dict[int, list[float]] = {}
    since_prev: dict[int, list[float]] = {}
    total: dict[int, list[float]] = {}
    passes: dict[int, list[int]] = {}
    ends: list[float] = []
    for _ in range(runs):
        api.call("MemsetD8_v2", ctypes.c_uint64(ptr), ctypes.c_ubyte(0), ctypes.c_size_t(size))
        timer.flush_l2()
        run(data)
        torch.cuda.synchronize()
        blocks = [b for b in stamps(api, ptr, size) if b[0]]
        t0 = min(b[0] for b in blocks)
        ends.append((max(max(b[:PHASES]) for b in blocks) - t0) / 1e3)
        for b in blocks:
            prev = None
            for k, g in enumerate(b[:PHASES]):
                if not g:
                    continue
                since_start.setdefault(k, []).append((g - t0) / 1e3)
                total.setdefault(k, []).append(b[PHASES + k] / 1e3)
                passes.setdefault(k, []).append(b[2 * PHASES + k])
                if prev is not None:
                    since_prev.setdefault(k, []).append((g - prev) / 1e3)
                prev = g
    names = family.phase_names()
    print(f"{text}  {'ok' if res.ok else 'WRONG'} (err {res.max_abs_err:.3g}); "
          f"last stamp {statistics.median(ends):.2f} us after the first block's start "
          f"(median of {runs})")
    print(f"  {'phase':34} {'us from start':>14} {'us in phase':>12} {'us in all':>10} "
          f"{'passes':>7}")
    for k in sorted(since_start):
        step = statistics.median(since_prev[k]) if k in since_prev else 0.0
        print(f"  {k} {names[k]:32} {statistics.median(since_start[k]):14.2f} {step:12.2f} "
              f"{statistics.median(total[k]):10.2f} {statistics.median(passes[k]):7.0f}")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+", help="FORMAT:BATCHxKV:KNOB=V,... (all knobs)")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="cuda_mma")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--heads", type=int, default=16)
    a = ap.parse_args()
    from mla_tune.backends import FAMILY_FILES_ENV, register

    family = FAMILIES[a.family]
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[FAMILY_FILES_ENV] = str(write_family(family, Path(tmp)))
        name = family.phases_name
        register(name, f"mla_tune.backends.compiled_source:family_{name}")
        for text in a.variants:
            profile(family, text, a.runs, a.heads)


if __name__ == "__main__":
    main()
