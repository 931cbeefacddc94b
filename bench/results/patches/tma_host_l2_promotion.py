"""Experiment (H200): does the host descriptors' L2 promotion explain why kv_load='tma_host'
is slower than per-program descriptors at long launches? (No: bench/results/triton_changes.md.)

Triton's host encoder asks for 128-byte L2 promotion; the per-program descriptors are
written from a zeroed template (no promotion). This wraps Triton's `fill_tma_descriptor`:
it checks that Triton's descriptor is byte-identical to cuTensorMapEncodeTiled with
128-byte promotion, then overwrites it in place with another promotion (none, 256 B), and
caches descriptors so no launch pays for encoding. An experiment, not product code: it
writes into a Triton object's memory. From the repository root, on a GPU:

    cp bench/results/patches/tma_host_l2_promotion.py bench/_promo.py
    python3 bench/_promo.py "fp8:256x8192:compute=fp8,block_n=64,num_stages=3,num_splits=1,fast_mode=1"
"""
import ctypes
import sys

import torch
from triton.runtime import driver

import benchkit
from mla_tune.kernels.triton import mla_decode as md
from mla_tune.tuning.timing import CudaTimer, TimingPolicy

lib = ctypes.CDLL("libcuda.so.1")
utils = driver.active.utils
orig_fill = utils.fill_tma_descriptor
PROMO = {"v": None}
stats = {"patched": 0, "checked": 0}

def encode(ptr, swizzle, elem_size, elem_type, block, shape, strides, promo):
    tm = (ctypes.c_uint64 * 16)()
    r = len(shape)
    dims = (ctypes.c_uint64 * r)(*reversed(shape))
    st = (ctypes.c_uint64 * (r - 1))(*[s * elem_size for s in reversed(strides[:-1])])
    box = (ctypes.c_uint32 * r)(*reversed(block))
    es = (ctypes.c_uint32 * r)(*([1] * r))
    rc = lib.cuTensorMapEncodeTiled(tm, ctypes.c_int(elem_type), ctypes.c_uint32(r), ctypes.c_void_p(ptr),
                                    dims, st, box, es, 0, ctypes.c_int(swizzle), ctypes.c_int(promo), 0)
    assert rc == 0, rc
    return ctypes.string_at(tm, 128)

CACHE = {}

def fill(ptr, swizzle, elem_size, elem_type, block, shape, strides, padding):
    key = (PROMO["v"], ptr, swizzle, elem_size, elem_type, tuple(block), tuple(shape), tuple(strides), padding)
    if key in CACHE:
        return CACHE[key]
    obj = orig_fill(ptr, swizzle, elem_size, elem_type, block, shape, strides, padding)
    CACHE[key] = obj
    if PROMO["v"] is None:
        return obj
    ref = encode(ptr, swizzle, elem_size, elem_type, block, shape, strides, 2)
    raw = ctypes.string_at(id(obj), 512)
    off = raw.find(ref)
    assert off >= 0, "Triton's descriptor is not the 128B-promotion encoding"
    stats["checked"] += 1
    new = encode(ptr, swizzle, elem_size, elem_type, block, shape, strides, PROMO["v"])
    ctypes.memmove(id(obj) + off, new, 128)
    stats["patched"] += 1
    return obj

utils.fill_tma_descriptor = fill
timer = CudaTimer(torch.device("cuda"), TimingPolicy(warmup=3, min_runs=20, max_runs=300, budget_s=0.4))
for text in sys.argv[1:]:
    shape, cfg = benchkit.parse_variant(text)
    data = benchkit.task_input(shape)
    args = benchkit.launcher_args(data, shape.kv_format)
    outs = {}
    for rnd in (1, 2):
        for load, promo in (("tma", None), ("tma_host", None), ("tma_host", 0), ("tma_host", 2), ("tma_host", 3)):
            PROMO["v"] = promo
            c = md.KernelConfig(**{**cfg.__dict__, "kv_load": load})
            L = benchkit.prepared_launcher(md, c, shape, data)
            out = L(*args).float().clone()
            key = (load, promo)
            if key != ("tma", None):
                d = (out - outs[("tma", None)]).abs().max().item()
            else:
                outs[key] = out; d = 0.0
            st = timer.measure(lambda: L(*args))
            print(f"r{rnd} {text:75} {load:8} promo={promo} median {st.median_us:7.1f} min {st.min_us:7.1f} maxdiff {d:.2g}", flush=True)
print(stats)
