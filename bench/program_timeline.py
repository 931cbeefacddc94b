"""When each split program starts and ends, in global time (a dev script for kernel work, not
a test and not the tuner): per program of the bf16/fp8 split kernel, `%globaltimer` at its
start, before and after its KV loop and after its epilogue, and the SM it ran on. It shows
whether a launch's time beyond its steady streaming is spent before the programs stream
(start-up), after their loops (epilogue, merge) or after the first ones finish (a tail of
stragglers). Ten launches, each after the timer's L2 flush.

    python3 bench/program_timeline.py fp8:256x8192:compute=fp8,block_n=64,kv_load=tma ...

Variants as in bench/kernel_probe.py (bf16/fp8). The probes live in a patched copy of
kernels/triton/mla_decode.py (each patch point is asserted, so a kernel change that moves
one fails loudly).
"""

from __future__ import annotations

import sys

import probed_kernel

import benchkit

PATCHES = [
    probed_kernel.register_readers({"_gtime": ("globaltimer", 64), "_smid": ("smid", 32)}),
    probed_kernel.at_program_start("t0 = _gtime(pid_m)"),
    ("""            desc_r = KV_DESC_R
        if (PAGED == 2) and (TMA != 0):""", """            desc_r = KV_DESC_R
        tl.store(dbg + 3, _gtime(tl.max(row_scale, 0) + lo))
        if (PAGED == 2) and (TMA != 0):"""),
    probed_kernel.at_loop_end("tl.store(dbg + 4, _gtime(tl.max(l_i, 0)))"),
    probed_kernel.at_program_end(["tl.store(dbg + 1, _gtime(pid_m))", "tl.store(dbg + 0, t0)",
                                  "tl.store(dbg + 2, _smid(pid_m).to(tl.int64))"]),
]
"""The timer probes (debug words: 0 start, 1 end, 2 SM, 3 loop start, 4 loop end), on top
of probed_kernel's debug buffer."""


def probed_module():
    """kernels/triton/mla_decode.py with the timer probes, imported from a temporary file."""
    return probed_kernel.probed_module(PATCHES, "mla_decode_timeline")


def main() -> None:
    import torch

    md = probed_module()
    for text in sys.argv[1:]:
        if benchkit.parse_variant(text)[0].kv_format.value == "mxfp4":
            raise SystemExit(f"{text}: only bf16/fp8 variants are probed")
        launcher, call = probed_kernel.probed_launcher(md, text)
        rows = [t[t[:, 1] > 0][:, :5].double()
                for t in probed_kernel.debug_rows(launcher, call)]
        print(f"{text}  ({rows[0].shape[0]} programs; us from the first start, median of "
              f"10 launches)")

        def us(x: torch.Tensor, p: float) -> float:
            return x.quantile(p).item() / 1e3

        stats = {name: [] for name in ("start p50", "start max", "end min", "end p10",
                                       "end p50", "end p90", "end max", "busy p50",
                                       "to loop p50", "loop p50", "after loop p50")}
        for t in rows:
            start, end = t[:, 0] - t[:, 0].min(), t[:, 1] - t[:, 0].min()
            for name, d in (("to loop p50", t[:, 3] - t[:, 0]), ("loop p50", t[:, 4] - t[:, 3]),
                            ("after loop p50", t[:, 1] - t[:, 4])):
                stats[name].append(us(d, .5))
            for name, value in (("start p50", us(start, .5)), ("start max", us(start, 1.)),
                                ("end min", us(end, 0.)), ("end p10", us(end, .1)),
                                ("end p50", us(end, .5)), ("end p90", us(end, .9)),
                                ("end max", us(end, 1.)), ("busy p50", us(end - start, .5))):
                stats[name].append(value)
        print("   " + "  ".join(f"{k} {torch.tensor(v).median().item():7.1f}"
                               for k, v in stats.items()))
        t = rows[-1]
        per_sm = torch.bincount(t[:, 2].long())
        shared = per_sm[t[:, 2].long()] > 1
        end = (t[:, 1] - t[:, 0].min()) / 1e3
        print(f"   last launch: end p50 of programs sharing an SM {end[shared].median():.1f}"
              f", alone {end[~shared].median() if (~shared).any() else float('nan'):.1f}"
              f"; SMs used {int((per_sm > 0).sum())}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main()
