"""Check every variant of a compiled-source family against the float32 reference on a GPU.

Cases: each KV format of the family x (q_len, heads) in {1, 4} x {16, 128} x a ragged
batch (kv lengths 5 .. 1500, so some splits are empty and tiles are partial) and a uniform
one, each also with a loud cache (`LOUD`: 40 of every 97 keys x 8, so most of their MXFP4
block scale bytes are above 128 and the other keys' are not: kernels that special-case
large scales must handle both). The loud cases are judged with the gate's atol x LOUD:
scaling the cache scales the outputs and the bf16 rounding of P with it, while a lost
scale factor (a power of two, at least 2) or token still lands far outside. Every compile
variant with every runtime knob value feasible for the shape is built through the backend,
run once and judged with the sweep's gate (configs/tolerances.toml).
Writes one JSON line per run to --json and prints a summary; exits 1 on any wrong run.

    python3 bench/check_cuda_family.py --backend cuda --json $OUT/check.jsonl
    # only some variants: a constraint over the knobs, as in the family file
    python3 bench/check_cuda_family.py --backend cuda_mma --where "CLUSTER > 0"
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import benchkit
from mla_tune.backends import get_backend
from mla_tune.backends.compiled_expr import parse
from mla_tune.problem.shapes import KVFormat, Shape

RAGGED = (5, 33, 64, 300, 1027, 1500)
LOUD = 8.0
"""Gain of the loud keys: block maxima of randn x 8 are 16-24, MXFP4 scale byte 129."""


def loud_input(shape: Shape, dev: torch.device, seed: int) -> tuple:
    """The task tuple with keys k, k % 97 < 40, scaled by LOUD before quantization."""
    from mla_tune.problem import quant

    q, kv_data, qo, kvp, config = benchkit.task_input(shape, dev, seed=seed)
    kv = kv_data["bf16"].float()
    keys = torch.arange(kv.shape[0], device=dev)
    kv[keys % 97 < 40] *= LOUD
    kv = kv.to(torch.bfloat16)
    loud = {"bf16": kv, "fp8": quant.quantize_fp8(kv), "mxfp4": quant.quantize_mxfp4(kv)}
    return q, loud, qo, kvp, config


def cases(formats: list[KVFormat]) -> list[Shape]:
    out = []
    for fmt in formats:
        for q_len in (1, 4):
            for heads in (16, 128):
                out.append(Shape(len(RAGGED), RAGGED, q_len, heads, fmt))
                out.append(Shape.uniform(4, 1024, q_len=q_len, heads=heads, kv_format=fmt))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--json", default=None)
    ap.add_argument("--where", default=None,
                    help="check only the variants whose knobs satisfy this expression")
    args = ap.parse_args()
    where = parse(args.where, "--where") if args.where else None
    dev = torch.device("cuda")
    backend = get_backend(args.backend)
    avail = backend.available(dev)
    if not avail:
        print(f"{args.backend} not available: {avail.reason}")
        return 2
    sink = open(args.json, "w") if args.json else None
    bad = runs = 0
    t0 = time.time()
    formats = [f for f in KVFormat if not backend.supports(Shape.uniform(1, 64, kv_format=f))]
    for shape, loud in [(s, loud) for s in cases(formats) for loud in (False, True)]:
        data = loud_input(shape, dev, 1) if loud else benchkit.task_input(shape, dev, seed=1)
        ref = benchkit.reference(data, shape.kv_format)
        worst = 0.0
        for config in backend.candidates(shape, dev):
            if where is not None and not where(config):
                continue
            row = {"shape": shape.key, "loud": loud, "config": config}
            why = backend.precheck(shape, config, dev)
            if why:
                row["skipped"] = why
            else:
                try:
                    out = backend.build(shape, config, dev)(data)
                    torch.cuda.synchronize()
                    res = benchkit.check(out, ref, shape.kv_format, LOUD if loud else 1.0)
                    row.update(ok=res.ok, max_abs_err=res.max_abs_err,
                               mismatch_frac=res.mismatch_frac, reason=res.reason)
                except Exception as e:  # noqa: BLE001 - reported per run
                    row.update(ok=False, reason=f"{type(e).__name__}: {e}")
                runs += 1
                bad += not row["ok"]
                worst = max(worst, row.get("max_abs_err") or 0.0)
                if not row["ok"]:
                    print(f"WRONG {shape.label()} loud={loud} {config}: {row['reason']}",
                          flush=True)
            if sink:
                sink.write(json.dumps(row) + "\n")
        print(f"{shape.label():32s} ragged={shape.is_ragged!s:5s} loud={loud!s:5s} "
              f"worst abs err {worst:.3g}",
              flush=True)
    print(f"{runs} runs, {bad} wrong, {time.time() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
