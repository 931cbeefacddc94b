"""Where one split program's time goes, phase by phase (a dev script for kernel work, not a
test and not the tuner): per program of the bf16/fp8 split kernel, SM clock cycles
(`%clock64`) from its start to the sequence bounds, to the query block in registers, to its
last tile in registers, to that tile's QK^T done, to the end of the KV loop, and to the end
of its epilogue (output or partial stored, merge if fused). Medians over programs and over
10 launches, each after the timer's L2 flush (cold, as the timing protocol).

    python3 bench/kernel_phases.py bf16:4x1024:num_splits=16,block_n=64 ...

Variants as in bench/kernel_probe.py (pointer loads; not MXFP4). The probes live in a
patched copy of kernels/triton/mla_decode.py built here (each patch point is asserted, so
a kernel change that moves one fails loudly); a probe waits for the value it depends on
(a reduction of it), which adds a few hundred cycles to the phase it ends.
"""

from __future__ import annotations

import sys

import probed_kernel

import benchkit

PHASES = ("bounds loaded", "query block loaded", "last tile in registers",
          "its QK^T done", "KV loop done", "epilogue done")
"""Probe k ends phase k; program start is probe 0 (slot order in the debug buffer below)."""

PATCHES = [
    probed_kernel.register_readers({"_clk": ("clock64", 64)}),
    probed_kernel.at_program_start("t0 = _clk(pid_m)"),
    ('''        kv_start, L, chunk, n_act = _split_bounds(KV_INDPTR, b, n_splits, BLOCK_N)
        if (r0 < rows) & (split < n_act):''', '''        kv_start, L, chunk, n_act = _split_bounds(KV_INDPTR, b, n_splits, BLOCK_N)
        t1 = _clk(kv_start + q_start)
        if (r0 < rows) & (split < n_act):'''),
    ('''        qr = tl.load(q_row + D_NOPE + offs_r[None, :], mask=row_ok[:, None], other=0.0)
''', '''        qr = tl.load(q_row + D_NOPE + offs_r[None, :], mask=row_ok[:, None], other=0.0)
        tl.store(dbg + 2, _clk(tl.max(tl.max(qr.to(tl.float32), 1), 0)))
'''),
    ('''    if COMPUTE == 3:
        # e4m3 QK^T on the tile as stored; only the values are converted, to fp16.''',
     '''    tl.store(DBG + 3, _clk(tl.max(tl.max(kr_raw.to(tl.float32), 1), 0)))
    if COMPUTE == 3:
        # e4m3 QK^T on the tile as stored; only the values are converted, to fp16.'''),
    ('''    s = s * row_scale[None, :]
    valid = n_ok[:, None] & (offs_n[:, None] <= limit[None, :])''',
     '''    tl.store(DBG + 4, _clk(tl.max(tl.max(s, 1), 0)))
    s = s * row_scale[None, :]
    valid = n_ok[:, None] & (offs_n[:, None] <= limit[None, :])'''),
    probed_kernel.at_loop_end("tl.store(dbg + 5, _clk(tl.max(l_i, 0)))"),
    probed_kernel.at_program_end(["tl.store(dbg + 6, _clk(pid_m))", "tl.store(dbg + 0, t0)",
                                  "tl.store(dbg + 1, t1)"]),
    ("def _attend_tile(kn_raw, kr_raw,", "def _attend_tile(DBG, kn_raw, kr_raw,"),
    ("    return _attend_tile(kn_raw, kr_raw, offs_n, n_ok, sc_stride, qnT,",
     "    return _attend_tile(DBG, kn_raw, kr_raw, offs_n, n_ok, sc_stride, qnT,"),
    ("def _attend_kv_tile(KV, desc_n,", "def _attend_kv_tile(DBG, KV, desc_n,"),
    ('''            for n0 in range(lo, hi, BLOCK_N):
                m_i, l_i, acc = _attend_kv_tile(
                    KV,''', '''            for n0 in range(lo, hi, BLOCK_N):
                m_i, l_i, acc = _attend_kv_tile(
                    dbg, KV,'''),
]
"""The clock probes, on top of probed_kernel's debug buffer."""


def probed_module():
    """kernels/triton/mla_decode.py with the clock probes, imported from a temporary file."""
    return probed_kernel.probed_module(PATCHES, "mla_decode_probed")


def main() -> None:
    import torch

    md = probed_module()
    for text in sys.argv[1:]:
        shape, cfg = benchkit.parse_variant(text)
        if shape.kv_format.value == "mxfp4" or cfg.tma():
            raise SystemExit(f"{text}: only bf16/fp8 variants with pointer loads are probed")
        launcher, call = probed_kernel.probed_launcher(md, text)
        runs = [t[:, :7] for t in probed_kernel.debug_rows(launcher, call)]
        t = torch.cat([r[r[:, 6] > 0] for r in runs]).double()
        print(f"{text}  ({t.shape[0] // 10} programs; cycles, median [p10, p90])")
        for k, name in enumerate(PHASES):
            d = t[:, k + 1] - t[:, k]
            print(f"   {name:24} {d.median().item():8.0f}  [{d.quantile(0.1).item():.0f}, "
                  f"{d.quantile(0.9).item():.0f}]")
        print(f"   {'total':24} {(t[:, 6] - t[:, 0]).median().item():8.0f}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main()
