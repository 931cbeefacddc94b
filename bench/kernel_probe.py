"""Time (or hand to a profiler) a few chosen Triton MLA decode variants side by side on a GPU:
a dev script for kernel work, not a test and not the tuner.

Each variant is `FORMAT:BATCHxKV:key=value,...` with KernelConfig's fields as keys, e.g.
`fp8:256x8192:compute=fp16,block_n=32,num_stages=3,num_splits=1,fast_mode=1`. Every variant
is checked against the float32 reference before it is timed (cold L2, the tuner's timer).

    python3 bench/kernel_probe.py VARIANT [VARIANT ...]            # time each
    ncu --kernel-name mla_decode_kernel python3 bench/kernel_probe.py --once VARIANT ...

`--once` launches each variant exactly once after its check (the check's own launch is the
one a profiler filtered on the split kernel sees first, so profile with --launch-skip 0 and
--launch-count 2 per variant, or read the second of each pair).

`--baseline FILE` times every variant a second time with the kernel source in FILE, right
after the checkout's, so an edit is compared with what it replaces in one run:

    git show HEAD:kernels/triton/mla_decode.py > bench/_base.py
    python3 bench/kernel_probe.py --baseline bench/_base.py VARIANT ...
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import fields
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from kernels.triton import mla_decode  # noqa: E402
from kernels.triton.mla_decode import KernelConfig  # noqa: E402
from mla_tune.problem import KVFormat  # noqa: E402
from mla_tune.timing import CudaTimer, TimingPolicy  # noqa: E402
from triton_dev import CEILING_TBS, make_inputs, reference  # noqa: E402


def parse_variant(text: str) -> tuple[str, int, int, KernelConfig]:
    """'fmt:BxKV:k=v,...' -> (format, batch, kv_len, config)."""
    fmt, shape, *rest = text.split(":")
    batch, kv_len = (int(x) for x in shape.lower().split("x"))
    types = {f.name: f.type for f in fields(KernelConfig)}
    kw: dict[str, object] = {"kv_format": fmt}
    for item in (rest[0].split(",") if rest and rest[0] else []):
        key, val = item.split("=")
        if key not in types:
            raise SystemExit(f"unknown knob {key!r}; KernelConfig has {sorted(types)}")
        t = types[key]
        kw[key] = (val if t in ("str", str) else
                   bool(int(val)) if t in ("bool", bool) else int(val))
    return fmt, batch, kv_len, KernelConfig(**kw)


def load_kernel(path: Path) -> ModuleType:
    """A kernel source file (another version of kernels/triton/mla_decode.py) as a module of
    its own, so its kernels compile and run next to the checkout's."""
    spec = importlib.util.spec_from_file_location(f"mla_decode_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def config_in(md: ModuleType, cfg: KernelConfig) -> Any:
    """`cfg` as the KernelConfig of kernel module `md` (another version of the kernel; knobs
    it does not have are left out)."""
    return md.KernelConfig(**{f.name: getattr(cfg, f.name) for f in fields(cfg)
                              if f.name in md.KernelConfig.__dataclass_fields__})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--once", action="store_true", help="launch once after the check")
    ap.add_argument("--budget", type=float, default=0.5, help="timing budget per variant, s")
    ap.add_argument("--baseline", type=Path,
                    help="also time each variant with the kernel source in this file")
    a = ap.parse_args()
    kernels: list[tuple[str, ModuleType]] = [("", mla_decode)]
    if a.baseline:
        kernels.append((" [baseline]", load_kernel(a.baseline)))
    timer = None if a.once else CudaTimer(torch.device("cuda"), TimingPolicy(
        warmup=3, min_runs=20, max_runs=300, budget_s=a.budget))
    cache: dict[tuple, tuple] = {}
    for text in a.variants:
        fmt, batch, kv_len, cfg = parse_variant(text)
        key = (fmt, batch, kv_len)
        if key not in cache:
            cache.clear()
            torch.cuda.empty_cache()
            q, args, qo, kvp = make_inputs(batch, kv_len, a.heads, fmt, "cuda")
            cache[key] = (q, args, qo, kvp, reference(q, args, fmt, batch, kv_len))
        q, args, qo, kvp, ref = cache[key]
        for tag, md in kernels:
            launcher = md.MlaDecodeLauncher(config_in(md, cfg), heads=a.heads, q_len=1,
                                            kv_lens=[kv_len] * batch, device="cuda")
            launcher.prepare(args[2].stride(0) if args[2] is not None else 0)
            out = launcher(q, *args, qo, kvp).float()
            err = (out - ref).abs()
            bad = float((err > 1e-2 + 1e-2 * ref.abs()).float().mean())
            line = f"{text + tag:90} err {float(err.max()):.3g} mism {bad:.2%}"
            if a.once:
                launcher(q, *args, qo, kvp)
                torch.cuda.synchronize()
            else:
                st = timer.measure(lambda: launcher(q, *args, qo, kvp))
                tbs = batch * kv_len * KVFormat(fmt).bytes_per_token / st.median_us / 1e6
                line += (f"  median {st.median_us:8.1f} us  min {st.min_us:8.1f}  "
                         f"{tbs:5.2f} TB/s {100 * tbs / CEILING_TBS:5.1f}%  "
                         f"splits {launcher.n_splits}")
            print(line, flush=True)


if __name__ == "__main__":
    main()
