"""Times bench/results/patches/rows_on_m_64.py (block_n, stages, TMA or pointer loads, splits) against FlashInfer fa3 at page sizes 1 and 64 and the shipped DB's bf16 and fp8 routes, side by side (cold L2). Run from the repository root on the GPU: python3 bench/results/patches/rows_on_m_64_bench.py"""
import sys, json, itertools, os
sys.path.insert(0, "bench/results/patches"); sys.path.insert(0, "bench")
import torch, triton
import benchkit
from rows_on_m_64 import Rows64
from mla_tune.backends import get_backend
from mla_tune.problem.shapes import Shape, KVFormat
from mla_tune.problem.verify import tolerance_for
from mla_tune.runtime.dispatcher import Dispatcher
from mla_tune.tuning.timing import CudaTimer, TimingPolicy
dev = torch.device("cuda", 0)
triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
timer = CudaTimer(dev, TimingPolicy(budget_s=0.05, max_runs=100))
mla = Dispatcher.from_db(None, dev)
fi = get_backend("flashinfer")
SHAPES = [(4,4,8192,32),(32,4,8192,32),(128,4,8192,16),(32,4,1024,16),(4,1,8192,128),(32,1,8192,64),(32,2,8192,32),(128,1,8192,128)]
out = {}
for (b, ql, kv, h) in SHAPES:
    shape = Shape(batch=b, kv_lens=(kv,)*b, q_len=ql, heads=h)
    data = benchkit.task_input(shape, dev)
    ref = benchkit.reference(data, "bf16")
    q, kvd, qo, kvp, _ = data
    kvt = kvd["bf16"]
    fns, labels = [], []
    for bn, st, tma, sp in itertools.product([64, 32], [2, 1], [True, False], [1, 2, 4, 8, 16, 32]):
        if sp * bn * 2 > kv: continue
        progs = -(-ql*h // 64) * b * sp
        if progs > 2200: continue
        try:
            r = Rows64(b, ql, h, kv, sp, dev, block_n=bn, stages=st, tma=tma)
            o = r(q, kvt, kvp); torch.cuda.synchronize()
            v = benchkit.check(o.view_as(ref), ref, "bf16")
            if not v.ok:
                print("WRONG", (b,ql,kv,h), bn, st, tma, sp, v, flush=True); continue
        except Exception as e:
            print("ERR", (b,ql,kv,h), bn, st, tma, sp, str(e)[:200], flush=True); continue
        fns.append(lambda r=r: r(q, kvt, kvp)); labels.append(f"rows64 bn{bn} st{st} {'tma' if tma else 'ptr'} sp{sp}")
    for p in (1, 64):
        cfg = {"backend": "fa3", "page_size": p, "launch": "direct", "fp8_scale": "host"}
        try:
            f = fi.build(shape, cfg, dev); f(data); fns.append(lambda f=f: f(data)); labels.append(f"FI p{p}")
        except Exception as e: print("FI ERR", p, str(e)[:200])
    for fmt in ("bf16", "fp8"):
        s2 = shape.with_format(fmt); d2 = benchkit.task_input(s2, dev) if fmt != "bf16" else data
        dec = next(d for d in mla.decisions(s2) if get_backend(d.backend).precheck(s2, d.config, dev) is None)
        f = get_backend(dec.backend).build(s2, dec.config, dev); f(d2)
        fns.append(lambda f=f, d2=d2: f(d2)); labels.append(f"shipped {fmt} [{dec.reason}] {dict(dec.config)}")
    stats = timer.measure_interleaved(fns)
    res = sorted((s.median_us, l) for s, l in zip(stats, labels))
    key = f"{b}x{kv} q{ql} h{h}"
    out[key] = res
    print(key, flush=True)
    for us, l in res[:6]: print(f"   {us:8.1f} {l}", flush=True)
    for us, l in res:
        if not l.startswith("rows64"): print(f"   {us:8.1f} {l}", flush=True)
json.dump(out, open(os.environ.get("OUT", "out") + "/rows_on_m_64.json", "w"), indent=1)
