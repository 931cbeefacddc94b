"""A server's decode loop on MLADecodeWrapper: one plan per step, one run per layer.

    python3 examples/serving/decode_loop.py                 # CPU: the torch family
    python3 examples/serving/decode_loop.py --device cuda --db shipped --batch 32 \
        --layers 8 --steps 32 --lo 300 --hi 8000            # a GPU: tuned bucket runners

What a vLLM- or SGLang-style server does each decode step, with bf16 KV in pools of
64-token pages (one pool tensor per layer, pages of a sequence anywhere in it):
- the scheduler appends each sequence's new token to its last page (a new page when the
  last one is full) and rewrites the block table and lengths in its persistent buffers;
- attention is planned once for the step (`plan_block_table`: vLLM's block-table form)
  and run once per layer, each layer writing into its own output tensor (`out=`).
Lengths grow every step, yet a bucket's runner is built once: the loop prints the buckets
it went through and the runners built.
At the end every layer's last output is compared with the float32 reference of the same
tokens laid out contiguously; the exit status is 1 if any is off.
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

from mla_tune import MLADecodeWrapper
from mla_tune.problem.reference import mla_decode_reference
from mla_tune.problem.shapes import QK_HEAD_DIM, V_HEAD_DIM, Shape
from mla_tune.problem.verify import check, tolerance_for

PAGE = 64
HEADS = 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--db", default=None, help="winners: a tuning DB, or 'shipped'")
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lo", type=int, default=20, help="shortest first length")
    ap.add_argument("--hi", type=int, default=150, help="longest first length")
    a = ap.parse_args()
    dev = torch.device(a.device)
    rng = random.Random(0)
    gen = torch.Generator(device=dev).manual_seed(0)

    # The pool: pages handed out from a shuffled free list, as a server's allocator does.
    lens = [rng.randint(a.lo, a.hi) for _ in range(a.batch)]
    max_blocks = -(-(a.hi + a.steps) // PAGE)
    n_pages = a.batch * max_blocks
    free = list(range(n_pages))
    rng.shuffle(free)
    table = torch.full((a.batch, max_blocks), -1, dtype=torch.int32)  # -1: no page yet
    for b, length in enumerate(lens):
        for k in range(-(-length // PAGE)):
            table[b, k] = free.pop()
    pools = [torch.randn((n_pages, PAGE, QK_HEAD_DIM), generator=gen, device=dev)
             .to(torch.bfloat16) for _ in range(a.layers)]
    outs = [torch.empty((a.batch, HEADS, V_HEAD_DIM), dtype=torch.bfloat16, device=dev)
            for _ in range(a.layers)]
    # The server's persistent buffers: the block table and lengths on the device.
    table_buf = table.to(dev)
    lens_buf = torch.tensor(lens, dtype=torch.int32, device=dev)

    w = MLADecodeWrapper("bf16", HEADS, 1, PAGE, dev, db=a.db)
    builds, buckets = [], []
    for step in range(a.steps):
        if step:  # one new token per sequence: written into its slot, maybe a new page
            for b in range(a.batch):
                slot = lens[b]
                if slot % PAGE == 0:
                    table[b, slot // PAGE] = free.pop()
                lens[b] += 1
                page = int(table[b, slot // PAGE])
                for pool in pools:
                    pool[page, slot % PAGE] = torch.randn(QK_HEAD_DIM, generator=gen,
                                                          device=dev).to(torch.bfloat16)
            table_buf.copy_(table)
            lens_buf.copy_(torch.tensor(lens, dtype=torch.int32))
        # On a GPU the server checked its tables when it wrote them: check=False keeps the
        # plan free of host syncs (checking device tensors copies them to the host).
        w.plan_block_table(table_buf, lens_buf, check=dev.type == "cpu")
        qs = [torch.randn((a.batch, HEADS, QK_HEAD_DIM), generator=gen, device=dev)
              .to(torch.bfloat16) for _ in range(a.layers)]
        for q, pool, out in zip(qs, pools, outs):
            w.run(q, pool, out=out)
        builds.append(w.builds)
        if not buckets or buckets[-1] != w.bucket.label():
            buckets.append(w.bucket.label())
    print(f"{a.steps} steps in bucket(s) {', '.join(buckets)}; runners built: {builds[0]} "
          f"after the first step, {builds[-1]} after the last")

    # Every layer's last step against the reference of the same tokens, contiguous.
    config = Shape(a.batch, tuple(lens), heads=HEADS).task_config()
    qo = torch.arange(a.batch + 1, dtype=torch.int32)
    kv_indptr = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    bad = 0
    for n, (q, pool, out) in enumerate(zip(qs, pools, outs)):
        rows = [pool[int(table[b, t // PAGE]), t % PAGE] for b in range(a.batch)
                for t in range(lens[b])]
        kv = torch.stack(rows).view(-1, 1, QK_HEAD_DIM)
        ref = mla_decode_reference(q, {"bf16": kv}, qo, kv_indptr, config)
        res = check(out, ref, tolerance_for("bf16"))
        print(f"layer {n}: ok={res.ok} max_abs_err={res.max_abs_err:.3g} {res.reason}")
        bad += not res.ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
