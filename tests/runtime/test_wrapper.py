"""MLADecodeWrapper on shuffled page pools against the float32 reference: the torch
family's bucket build on CPU, the Triton family's (and the planning kernel) through the
Triton interpreter in a child process (this file run as a script), CUDA graphs on a GPU."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest
import torch

from mla_tune.problem.reference import mla_decode_reference
from mla_tune.problem.shapes import Shape, generate_input
from mla_tune.runtime.dispatcher import Dispatcher
from mla_tune.runtime.buckets import BucketEdges
from mla_tune.runtime.wrapper import MLADecodeWrapper, pages_of_class

LENS = (37, 130, 70)


def paged_pool(kv_data: dict, lens: tuple[int, ...], page: int, fmt: str, seed: int = 0,
               spare: int = 3, poison: bool = False) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The contiguous cache of `fmt` copied into pages at shuffled pool positions (plus
    spare pages); returns (kv_cache as `run` takes it, kv_indices, kv_indptr). `poison`:
    every slot no sequence holds is NaN (bf16, fp8) or has a NaN scale (MXFP4), as a
    server's pool may hold anything there."""
    g = torch.Generator().manual_seed(seed)
    n_pages = [-(-L // page) for L in lens]
    total = sum(n_pages) + spare
    perm = torch.randperm(total, generator=g).tolist()
    vals, aux = (kv_data["bf16"], None) if fmt == "bf16" else kv_data[fmt]
    width = vals.shape[-1]
    flat = torch.zeros((total * page, width), dtype=torch.float32).to(vals.dtype) \
        if fmt == "fp8" else torch.zeros((total * page, width), dtype=vals.dtype)
    sc = torch.full((total * page, 24), 255 if poison else 127,
                    dtype=torch.uint8) if fmt == "mxfp4" else None
    if poison and fmt != "mxfp4":
        flat.view(torch.uint8 if fmt == "fp8" else torch.int16).fill_(0x7F if fmt == "fp8"
                                                                      else 0x7FC0)
    idx, indptr, start, k = [], [0], 0, 0
    for L, n in zip(lens, n_pages):
        for j in range(n):
            p = perm[k]
            k += 1
            idx.append(p)
            r0, r1 = start + j * page, start + min(L, (j + 1) * page)
            flat[p * page: p * page + r1 - r0] = vals[r0:r1].reshape(r1 - r0, width)
            if sc is not None:
                sc[p * page: p * page + r1 - r0, :aux.shape[1]] = aux[r0:r1]
        start += L
        indptr.append(len(idx))
    pool = flat.view(total, page, width)
    cache = pool if fmt == "bf16" else (pool, aux if fmt == "fp8" else sc)
    return cache, torch.tensor(idx, dtype=torch.int32), torch.tensor(indptr, dtype=torch.int32)


def wrapper_error(fmt: str, page: int, q_len: int, dispatcher: Dispatcher,
                  lens: tuple[int, ...] = LENS, seed: int = 2,
                  poison: bool = False) -> tuple[float, Any]:
    """Max abs error of one plan + run against the reference (NaN if any output is);
    and the wrapper."""
    data = generate_input(Shape(len(lens), lens, q_len=q_len), seed=seed)
    q, kv_data, qo, kvp, config = data
    cache, idx, ptr = paged_pool(kv_data, lens, page, fmt, seed, poison=poison)
    w = MLADecodeWrapper(fmt, 16, q_len, page, dispatcher.device, dispatcher=dispatcher)
    w.plan(qo, ptr, idx, torch.tensor(lens, dtype=torch.int32))
    out = w.run(q, cache)
    ref = mla_decode_reference(q, kv_data, qo, kvp, config, kv_format=fmt)
    return float((out.float() - ref).abs().max()), w


@pytest.fixture(scope="module")
def cpu_dispatcher() -> Dispatcher:
    return Dispatcher([], "cpu")


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("q_len", [1, 4])
def test_wrapper_on_shuffled_pages_matches_reference(cpu_dispatcher: Dispatcher, fmt: str,
                                                     page: int, q_len: int) -> None:
    e, w = wrapper_error(fmt, page, q_len, cpu_dispatcher)
    assert e < 2e-2
    assert w.bucket is not None and w.bucket.page_size == page


def test_the_wrapper_is_exported() -> None:
    import mla_tune

    assert mla_tune.MLADecodeWrapper is MLADecodeWrapper
    assert "MLADecodeWrapper" in mla_tune.__all__


def test_block_table_form_is_the_same_call(cpu_dispatcher: Dispatcher) -> None:
    lens = (50, 20)
    data = generate_input(Shape(2, lens), seed=8)
    q, kv_data, qo, kvp, config = data
    cache, idx, ptr = paged_pool(kv_data, lens, 16, "bf16", 8)
    table = torch.full((2, 6), -1, dtype=torch.int32)  # unused entries hold anything
    for b in range(2):
        pages = idx[ptr[b]:ptr[b + 1]]
        table[b, :pages.numel()] = pages
    w = MLADecodeWrapper("bf16", 16, 1, 16, "cpu", dispatcher=cpu_dispatcher)
    w.plan_block_table(table, torch.tensor(lens, dtype=torch.int32))
    out = w.run(q, cache).clone()
    w.plan(qo, ptr, idx, torch.tensor(lens, dtype=torch.int32))
    assert torch.equal(out, w.run(q, cache))
    assert float((out.float() - mla_decode_reference(*data)).abs().max()) < 2e-2


@pytest.mark.parametrize("edges", [BucketEdges(), BucketEdges((100, 300, 1000))])
@pytest.mark.parametrize("batch,page,q_tokens", [(3, 1, 3), (5, 16, 20), (7, 64, 7),
                                                 (2, 64, 900), (1, 16, 4)])
def test_pages_of_class_is_every_page_count_of_the_class(edges: BucketEdges, batch: int,
                                                         page: int, q_tokens: int) -> None:
    """Against the fast plan's own arithmetic: pages x page size tokens (at least
    q_tokens), the mean over the batch rounded up, its kv class."""
    def cls(n: int) -> tuple[int, int]:
        return edges.kv_class(-(-max(n * page, q_tokens) // batch))

    for n in list(range(1, 400)) + [4095, 4096, 4097, 70001]:
        first, last = pages_of_class(*cls(n), batch, page, q_tokens)
        assert first <= n <= last
        assert cls(first) == cls(last) == cls(n)
        assert first == 1 or cls(first - 1) != cls(n)
        assert cls(last + 1) != cls(n)


def _growing_steps(n: int = 6) -> list[tuple[Any, ...]]:
    """A growing loop's steps: (data, pool, kv_indices, kv_indptr, lengths tensor)."""
    steps = []
    for step in range(n):
        lens = tuple(L + step for L in (70, 90, 100))
        data = generate_input(Shape(3, lens), seed=step)
        cache, idx, ptr = paged_pool(data[1], lens, 16, "bf16", step)
        steps.append((data, cache, idx, ptr, torch.tensor(lens, dtype=torch.int32)))
    return steps


def test_growing_loop_builds_once_and_reads_the_metadata_as_given() -> None:
    w = MLADecodeWrapper("bf16", 16, 1, 16, "cpu", dispatcher=Dispatcher([], "cpu"))
    for step, (data, cache, idx, ptr, lens) in enumerate(_growing_steps()):
        w.plan(data[2], ptr, idx, lens)
        out = w.run(data[0], cache)
        # int32, contiguous, aligned: the runner reads the caller's tensors, nothing copied.
        assert all(a is b for a, b in zip(w._bound, (data[2], lens, ptr, idx)))
        if step in (0, 5):
            assert float((out.float() - mla_decode_reference(*data)).abs().max()) < 2e-2
    assert w.builds == 1


def test_plan_dispatches_no_torch_op() -> None:
    """A plan of device-ready metadata (check=False) allocates, copies and launches
    nothing: the only torch operators it runs read the host-side lengths for the route
    (on a CPU device the lengths are on the host; a GPU plan with device lengths reads
    the page count instead and runs none)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    w = MLADecodeWrapper("bf16", 16, 1, 16, "cpu", dispatcher=Dispatcher([], "cpu"))
    steps = _growing_steps(3)
    data, cache, idx, ptr, lens = steps[0]
    w.plan(data[2], ptr, idx, lens, check=False)  # the bucket's first plan builds
    w.run(data[0], cache)
    for data, cache, idx, ptr, lens in steps[1:]:
        with Ops() as mode:
            w.plan(data[2], ptr, idx, lens, check=False)
        assert set(mode.ops) <= {"aten.max.default", "aten.sum.default",
                                 "aten._local_scalar_dense.default"}, mode.ops
    copied = MLADecodeWrapper("bf16", 16, 1, 16, "cpu", dispatcher=Dispatcher([], "cpu"),
                              use_cuda_graph=True)
    copied.plan(data[2], ptr, idx, lens, check=False)
    with Ops() as mode:  # the copy mode does run copies (the check above can fail)
        copied.plan(data[2], ptr, idx, lens, check=False)
    assert any("copy" in op for op in mode.ops)


def test_copied_metadata_stays_in_the_same_buffers_and_gives_the_same_output() -> None:
    """use_cuda_graph=True, and metadata the kernels cannot read as given (int64, a
    misaligned slice, on the host for another device): copied into the wrapper's buffers,
    the same addresses every step, the same output as direct reads."""
    disp = Dispatcher([], "cpu")
    direct = MLADecodeWrapper("bf16", 16, 1, 16, "cpu", dispatcher=disp)
    graph = MLADecodeWrapper("bf16", 16, 1, 16, "cpu", dispatcher=disp, use_cuda_graph=True)
    addrs = set()
    for data, cache, idx, ptr, lens in _growing_steps(4):
        direct.plan(data[2], ptr, idx, lens)
        want = direct.run(data[0], cache).clone()
        graph.plan(data[2], ptr, idx, lens)
        assert not any(a is b for a, b in zip(graph._bound, (data[2], lens, ptr, idx)))
        addrs.add(tuple(t.data_ptr() for t in graph._bound))
        assert torch.equal(graph.run(data[0], cache), want)
        odd = torch.zeros(idx.numel() + 1, dtype=torch.int32)
        odd[1:] = idx  # a view starting 4 bytes into its storage: not 16-byte aligned
        direct.plan(data[2].long(), ptr.long(), odd[1:], lens.long())
        assert direct._bound[3] is not idx and torch.equal(direct.run(data[0], cache), want)
    assert len(addrs) == 1


def _planned(page: int = 16) -> tuple[MLADecodeWrapper, Any, Any, Any, Any]:
    lens = (40, 20)
    data = generate_input(Shape(2, lens), seed=1)
    cache, idx, ptr = paged_pool(data[1], lens, page, "bf16", 1)
    w = MLADecodeWrapper("bf16", 16, 1, page, "cpu", dispatcher=Dispatcher([], "cpu"))
    return w, data, cache, idx, ptr


def test_bad_page_tables_are_refused_before_any_launch() -> None:
    w, data, cache, idx, ptr = _planned()
    q, qo = data[0], data[2]
    lens = torch.tensor([40, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match="run before plan"):
        w.run(q, cache)
    with pytest.raises(ValueError, match="beyond its 3 page"):
        w.plan(qo, ptr, idx, torch.tensor([49, 20], dtype=torch.int32))
    bad = idx.clone()
    bad[1] = -1
    with pytest.raises(ValueError, match="page indices must be >= 0"):
        w.plan(qo, ptr, bad, lens)
    with pytest.raises(ValueError, match="kv_indptr must rise"):
        w.plan(qo, torch.tensor([0, 3, 2], dtype=torch.int32), idx, lens)
    with pytest.raises(ValueError, match="qo_indptr must be"):
        w.plan(torch.tensor([0, 2, 3], dtype=torch.int32), ptr, idx, lens)
    with pytest.raises(ValueError, match="shorter|< q_len"):
        w.plan(qo, ptr, idx, torch.tensor([0, 20], dtype=torch.int32))
    out_of_pool = idx.clone()
    out_of_pool[0] = cache.shape[0]  # one past the pool's last page
    w.plan(qo, ptr, out_of_pool, lens)
    with pytest.raises(ValueError, match="the pool has"):
        w.run(q, cache)


def test_bad_pools_and_queries_are_refused() -> None:
    w, data, cache, idx, ptr = _planned()
    w.plan(data[2], ptr, idx, [40, 20])
    with pytest.raises(ValueError, match=r"\(num_pages, 16, 576\)"):
        w.run(data[0], cache.view(-1, 8, 576))  # another page size
    with pytest.raises(ValueError, match="q must be"):
        w.run(data[0][:1], cache)
    fp8 = MLADecodeWrapper("fp8", 16, 1, 16, "cpu", dispatcher=Dispatcher([], "cpu"))
    fp8.plan(data[2], ptr, idx, [40, 20])
    with pytest.raises(ValueError, match="pair"):
        fp8.run(data[0], cache)
    with pytest.raises(ValueError, match="page_size must be a power of two"):
        MLADecodeWrapper("bf16", 16, 1, 48, "cpu", dispatcher=Dispatcher([], "cpu"))


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_one_plan_runs_every_layer_on_its_own_pool(cpu_dispatcher: Dispatcher,
                                                   fmt: str) -> None:
    """A model plans once per step and runs once per layer, each layer on its own pool:
    every run reads its own pool, and each pool is checked once while it lives."""
    lens = (37, 70)
    layers = []
    for seed in (3, 4, 5):  # the same page table, other values
        q, kv_data, qo, kvp, config = generate_input(Shape(2, lens), seed=seed)
        cache, idx, ptr = paged_pool(kv_data, lens, 16, fmt, seed=1)
        ref = mla_decode_reference(q, kv_data, qo, kvp, config, kv_format=fmt)
        layers.append((q, cache, ref))
    w = MLADecodeWrapper(fmt, 16, 1, 16, "cpu", dispatcher=cpu_dispatcher)
    checked = []
    check = w._pool
    w._pool = lambda kv_cache: checked.append(kv_cache) or check(kv_cache)
    w.plan(qo, ptr, idx, torch.tensor(lens, dtype=torch.int32))
    for _ in range(2):  # two steps
        for q, cache, ref in layers:
            assert float((w.run(q, cache).float() - ref).abs().max()) < 2e-2
    assert len(checked) == 3
    q, cache, _ = layers.pop()
    bad = cache.view(-1, 8, 576) if fmt == "bf16" else (cache[0].view(-1, 8, cache[0].shape[-1]),
                                                          cache[1])
    del cache
    with pytest.raises(ValueError, match=r"\(num_pages, 16, "):
        w.run(q, bad)  # a pool never checked is checked, whatever ids it reuses
    if fmt != "bf16":  # the same values with another scale tensor: checked again
        q, cache, ref = layers[0]
        w.run(q, (cache[0], cache[1].clone()))
        assert len(checked) == 5


def _out_case(fmt: str, dispatcher: Dispatcher) -> dict[str, Any]:
    """Two layers (own queries and pools, one plan) run with out=: each layer's output in
    its own tensor, returned as given, against the reference; the runner's own buffer
    (filled with NaN before) left alone."""
    lens = (37, 100, 70)
    layers = []
    for seed in (7, 8):
        q, kv_data, qo, kvp, config = generate_input(Shape(3, lens), seed=seed)
        cache, idx, ptr = paged_pool(kv_data, lens, 16, fmt, seed=1)
        ref = mla_decode_reference(q, kv_data, qo, kvp, config, kv_format=fmt)
        layers.append((q, cache, ref, torch.full((3, 16, 512), 7.0, dtype=torch.bfloat16)))
    w = MLADecodeWrapper(fmt, 16, 1, 16, "cpu", dispatcher=dispatcher)
    w.plan(qo, ptr, idx, torch.tensor(lens, dtype=torch.int32))
    own = getattr(w._route.runner, "launcher", None)
    if own is not None:
        own.out.fill_(float("nan"))
    same = all(w.run(q, cache, out=o) is o for q, cache, _, o in layers)
    err = max(float((o.float() - ref).abs().max()) for _, _, ref, o in layers)
    untouched = own is None or bool(own.out.isnan().all())
    return {"err": err, "same": same, "untouched": untouched,
            "backend": w._route.runner.decision.backend}


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_run_writes_each_layers_output_into_its_out(cpu_dispatcher: Dispatcher,
                                                    fmt: str) -> None:
    r = _out_case(fmt, cpu_dispatcher)
    assert r["same"] and r["err"] < 2e-2, r


def test_a_bad_out_is_refused_before_any_launch() -> None:
    w, data, cache, idx, ptr = _planned()
    w.plan(data[2], ptr, idx, [40, 20])
    good = torch.zeros((2, 16, 512), dtype=torch.bfloat16)
    for bad, why in ((good.float(), "float32"), (good[:1], r"\(1, 16, 512\)"),
                     (torch.zeros((2, 512, 16), dtype=torch.bfloat16).transpose(1, 2),
                      "not contiguous"), (good.tolist(), "list")):
        with pytest.raises(ValueError, match=rf"out must be .*\(2, 16, 512\).*{why}"):
            w.run(data[0], cache, out=bad)
    assert not good.any()
    assert w.run(data[0], cache, out=good) is good and good.any()


def test_the_serving_example_decodes_every_layer_right() -> None:
    """examples/serving/decode_loop.py: a block table and lengths rewritten in persistent
    buffers each step, one plan per step, each layer into its own `out`; it checks every
    layer's last step against the reference and exits 1 when one is off."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "examples/serving/decode_loop.py", "--layers", "3",
                           "--steps", "4"], cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert [line.split(":")[1].split()[0] for line in proc.stdout.splitlines()
            if line.startswith("layer ")] == ["ok=True"] * 3, proc.stdout


def test_triton_wrapper_and_planning_kernel_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    from tests.compiled_child import interpreted_rows

    rows = interpreted_rows(__file__, timeout=600)
    assert set(rows) == set(INTERP_CASES) | set(OUT_CASES) | {
        "planner_batch_600", "task_ragged", "int64_metadata_copied"}
    for name in OUT_CASES:
        r = rows[name]
        assert r["backend"] == "triton" and r["same"] and r["untouched"], r
        assert r["err"] < 2e-2, r
    for name, (fmt, _, _, _) in INTERP_CASES.items():
        r = rows[name]
        assert r["backend"] == "triton", r
        assert r["err"] < (0.08 if fmt == "fp8" else 2e-2), r
    assert rows["planner_batch_600"]["ok"], rows["planner_batch_600"]
    assert rows["int64_metadata_copied"]["err"] < 2e-2, rows["int64_metadata_copied"]
    assert rows["task_ragged"]["backend"] == "triton" and rows["task_ragged"]["err"] < 2e-2


def _gpu_steps(dev: torch.device, n: int = 4) -> list[tuple[Any, ...]]:
    """A growing loop on the GPU: (q, pool, kv_indices, kv_indptr, lengths), all on dev."""
    steps = []
    for s in range(n):
        lens = tuple(L + s for L in (300, 700, 500))
        data = generate_input(Shape(3, lens), seed=0, device=dev)
        cache, idx, ptr = paged_pool({"bf16": data[1]["bf16"].cpu()}, lens, 16, "bf16")
        steps.append((data[0], cache.to(dev), idx.to(dev), ptr.to(dev),
                      torch.tensor(lens, dtype=torch.int32, device=dev)))
    return steps


class _ServerBuffers:
    """A server's persistent tensors sized for the last (largest) of `steps`: `write(s)`
    copies step s into them and returns the view of the page indices as long as its
    pages."""

    def __init__(self, steps: list[tuple[Any, ...]], dev: torch.device) -> None:
        self.steps = steps
        q, pool, idx, ptr, lens = steps[-1]
        self.q, self.pool = q.clone(), torch.zeros_like(pool)
        self.idx, self.ptr, self.lens = (torch.zeros_like(t) for t in (idx, ptr, lens))
        self.qo = torch.arange(4, dtype=torch.int32, device=dev)

    def write(self, s: int) -> torch.Tensor:
        q, c, i, p, n = self.steps[s]
        self.q.copy_(q)
        self.pool[:c.shape[0]].copy_(c)
        self.idx.zero_()[:i.numel()].copy_(i)
        self.ptr.copy_(p)
        self.lens.copy_(n)
        return self.idx[:i.numel()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_cuda_graph_replay_matches_eager_across_steps() -> None:
    """Direct reads: the graph replays the captured tensors, each step written into them;
    a plan with other tensors is refused. use_cuda_graph=True: any tensors each step."""
    dev = torch.device("cuda", torch.cuda.current_device())
    steps = _gpu_steps(dev)
    for copy in (False, True):
        w = MLADecodeWrapper("bf16", 16, 1, 16, dev, dispatcher=Dispatcher([], dev),
                             use_cuda_graph=copy)
        q_buf, pool = steps[-1][0].clone(), torch.zeros_like(steps[-1][1])
        idx_buf = torch.zeros_like(steps[-1][2])
        ptr_buf, lens_buf = torch.zeros_like(steps[-1][3]), torch.zeros_like(steps[-1][4])
        qo = torch.arange(4, dtype=torch.int32, device=dev)

        def load(s: int) -> None:
            q, c, i, p, n = steps[s]
            q_buf.copy_(q)
            pool[:c.shape[0]].copy_(c)
            if copy:  # fresh tensors every step
                w.plan(qo.clone(), p.clone(), i.clone(), n.clone(), check=False)
                return
            idx_buf.zero_()[:i.numel()].copy_(i)  # written into the same tensors
            ptr_buf.copy_(p)
            lens_buf.copy_(n)
            w.plan(qo, ptr_buf, idx_buf[:i.numel()], lens_buf, check=False)

        eager = []
        for s in range(4):
            load(s)
            eager.append(w.run(q_buf, pool).clone())
        load(0)
        w.run(q_buf, pool)  # compiled and warm before the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = w.run(q_buf, pool)
        bucket = w.bucket
        for s in range(4):
            load(s)
            assert w.bucket == bucket  # one bucket: one graph serves every step
            g.replay()
            assert torch.equal(out, eager[s])
        if not copy:
            q, c, i, p, n = steps[0]
            with pytest.raises(ValueError, match="CUDA graph captured run"):
                w.plan(qo, p.clone(), i.clone(), n.clone(), check=False)
            with pytest.raises(ValueError, match="CUDA graph captured run"):
                w.plan(qo, ptr_buf, idx_buf.clone()[:i.numel()], lens_buf, check=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="launch graphs need a CUDA GPU")
def test_graph_launches_replay_what_eager_launches_compute() -> None:
    """Steps written into the same tensors: the second run captures, later runs replay a
    graph, outputs equal a wrapper launching eagerly; new addresses launch eagerly."""
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = _ServerBuffers(_gpu_steps(dev), dev)
    outs = []
    for graphs in (True, False):
        w = MLADecodeWrapper("bf16", 16, 1, 16, dev, dispatcher=Dispatcher([], dev),
                             graph_launches=graphs)
        got = []
        for s in (0, 1, 2, 3, 3, 2):
            w.plan(buf.qo, buf.ptr, buf.write(s), buf.lens, check=False)
            got.append(w.run(buf.q, buf.pool).clone())
        graphed = w._route.graphed
        if graphs:
            assert graphed is not None and graphed.captures == 1
            w.plan(buf.qo, buf.ptr.clone(), buf.idx.clone(), buf.lens.clone(), check=False)
            assert torch.equal(w.run(buf.q, buf.pool), got[-1])  # other tensors: eager
            assert graphed.captures == 1
        else:
            assert graphed is None
        outs.append(got)
    torch.cuda.synchronize()
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="launch graphs need a CUDA GPU")
@pytest.mark.parametrize("own_out", [False, True])
def test_each_layer_replays_its_own_launch_graph(own_out: bool) -> None:
    """One plan per step, one run per layer on the layer's own pool and query (steps
    written into the same tensors), with `own_out` into the layer's own output tensor:
    each layer captures its graph on its second step, and every output equals a wrapper
    launching eagerly into its own buffer."""
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = _ServerBuffers(_gpu_steps(dev), dev)
    layers = [(buf.q + 0.5 * n, buf.pool * (1 + n)) for n in range(3)]
    outs = []
    for graphs in (True, False):
        w = MLADecodeWrapper("bf16", 16, 1, 16, dev, dispatcher=Dispatcher([], dev),
                             graph_launches=graphs)
        got = []
        given = [torch.empty((buf.q.shape[0], 16, 512), dtype=torch.bfloat16, device=dev)
                 for _ in layers] if own_out and graphs else [None] * len(layers)
        for s in (0, 1, 2, 3):
            idx = buf.write(s)
            w.plan(buf.qo, buf.ptr, idx, buf.lens, check=False)
            for n, (q, pool) in enumerate(layers):
                q.copy_(buf.q + 0.5 * n)
                pool.copy_(buf.pool * (1 + n))
                o = w.run(q, pool, out=given[n])
                assert given[n] is None or o is given[n]
                got.append(o.clone())
        if graphs:
            assert w._route.graphed.captures == len(layers)
        outs.append(got)
    torch.cuda.synchronize()
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert not torch.equal(outs[0][0], outs[0][1])  # the layers' outputs differ


# -- the interpreter child ---------------------------------------------------------------

INTERP_CASES = {
    "bf16_p16_q1": ("bf16", 16, 1, ""),
    "bf16_p1_q4_2splits_fused": ("bf16", 1, 4, "triton:num_splits=2,fast_mode=true"),
    "fp8_p1_q4": ("fp8", 1, 4, ""),
    "fp8_p64_2splits": ("fp8", 64, 1, "triton:num_splits=2,compute=fp8"),
    "mxfp4_p64_q1": ("mxfp4", 64, 1, ""),
    "mxfp4_p16_q4_splits": ("mxfp4", 16, 4, "triton:num_splits=2"),
}
"""Each runs on a pool whose unused slots are NaN (`paged_pool(poison=True)`)."""

OUT_CASES = {
    "out_fused_merge": "triton:num_splits=2,fast_mode=true",
    "out_merge_kernel": "triton:num_splits=2,fast_mode=false",
}
"""`_out_case` through the Triton runner, its output written by the split kernel's fused
merge or by the merge kernel."""


def _child() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    for name, (fmt, page, q_len, force) in INTERP_CASES.items():
        os.environ["MLA_TUNE_FORCE"] = force
        e, w = wrapper_error(fmt, page, q_len, Dispatcher([], "cpu"), lens=(37, 100, 70),
                             poison=True)
        print(json.dumps({"name": name, "err": e,
                          "backend": w._route.runner.decision.backend}), flush=True)
    for name, force in OUT_CASES.items():
        os.environ["MLA_TUNE_FORCE"] = force
        print(json.dumps({"name": name, **_out_case("bf16", Dispatcher([], "cpu"))}),
              flush=True)
    os.environ["MLA_TUNE_FORCE"] = ""
    from mla_tune.kernels.triton.serving_plan import ServingPlanLauncher

    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 200, (600,), generator=g, dtype=torch.int32)
    ptr = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(lens, 0).to(torch.int32)])
    idx = torch.randint(0, 10 ** 5, (int(ptr[-1]),), generator=g, dtype=torch.int32)
    lens_out, idx_out = torch.full((600,), -7, dtype=torch.int32), torch.zeros_like(idx)
    out_ptr, qo, qo_out = (torch.zeros(601, dtype=torch.int32),
                           torch.arange(601, dtype=torch.int64) * 2,
                           torch.zeros(601, dtype=torch.int32))
    ServingPlanLauncher(torch.device("cpu"))(lens.long(), idx.long(), ptr, qo, lens_out,
                                             idx_out, out_ptr, qo_out)
    ok = torch.equal(lens_out, lens) and torch.equal(idx_out, idx) and \
        torch.equal(out_ptr, ptr) and torch.equal(qo_out, qo.int())
    print(json.dumps({"name": "planner_batch_600", "ok": bool(ok)}), flush=True)
    # int64 metadata through the wrapper: the copy kernel writes its buffers.
    lens3 = (37, 100, 70)
    data = generate_input(Shape(3, lens3), seed=6)
    cache, idx3, ptr3 = paged_pool(data[1], lens3, 16, "bf16", 6)
    w = MLADecodeWrapper("bf16", 16, 1, 16, "cpu", dispatcher=Dispatcher([], "cpu"))
    w.plan(data[2].long(), ptr3.long(), idx3.long(), torch.tensor(lens3))
    err = float((w.run(data[0], cache).float() - mla_decode_reference(*data)).abs().max())
    print(json.dumps({"name": "int64_metadata_copied", "err": err}), flush=True)
    from mla_tune.runtime.buckets import router_for

    d = Dispatcher([], "cpu", kv_format="bf16")
    data = generate_input(Shape(3, (37, 100, 70)), seed=5)
    err = float((d.run(data).float() - mla_decode_reference(*data)).abs().max())
    backend = next(iter(router_for(d)._runners.values())).decision.backend
    print(json.dumps({"name": "task_ragged", "err": err, "backend": backend}), flush=True)


if __name__ == "__main__":
    _child()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fast plan path needs a CUDA GPU")
def test_plan_with_the_same_tensors_reads_their_new_contents() -> None:
    """A server's persistent buffers, rewritten and planned each step (the plan that only
    compares them with the last one's), also with a new view of the page-index buffer each
    step: outputs equal those of new tensors each step, and a plan with other tensors in
    between is taken in full."""
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = _ServerBuffers(_gpu_steps(dev), dev)
    qo, ptr, idx, lens = buf.qo, buf.ptr, buf.idx, buf.lens
    same = MLADecodeWrapper("bf16", 16, 1, 16, dev, dispatcher=Dispatcher([], dev))
    viewed = MLADecodeWrapper("bf16", 16, 1, 16, dev, dispatcher=Dispatcher([], dev))
    fresh = MLADecodeWrapper("bf16", 16, 1, 16, dev, dispatcher=Dispatcher([], dev))
    for s in (0, 1, 2, 3, 1):
        pages = buf.write(s)
        same.plan(qo, ptr, idx, lens, check=False)
        got = same.run(buf.q, buf.pool).clone()
        fresh.plan(qo.clone(), ptr.clone(), idx.clone(), lens.clone(), check=False)
        assert torch.equal(got, fresh.run(buf.q, buf.pool))
        # A new view of the page-index buffer each step, as long as the step's pages.
        viewed.plan(qo, ptr, pages, lens, check=False)
        got_view = viewed.run(buf.q, buf.pool).clone()
        fresh.plan(qo.clone(), ptr.clone(), pages.clone(), lens.clone(), check=False)
        assert torch.equal(got_view, fresh.run(buf.q, buf.pool))
        if s == 2:  # other tensors in between, then the buffers again
            same.plan(qo.clone(), ptr.clone(), idx.clone(), lens.clone(), check=False)
            same.plan(qo, ptr, idx, lens, check=False)
            assert torch.equal(same.run(buf.q, buf.pool), got)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fast plan path needs a CUDA GPU")
def test_new_page_views_with_new_counts_keep_or_leave_the_bucket_as_a_full_plan() -> None:
    """Pages of one token: every step of a growing loop has more pages, the server's
    page-index view is a new tensor each step; the plan that queries only that view takes
    the same bucket as a plan of new tensors (also across the class edge at a mean of 2048)
    and the same output."""
    dev = torch.device("cuda", torch.cuda.current_device())
    steps = []
    for s in range(5):  # means 2046 .. 2050
        lens = tuple(L + s for L in (2046, 2040, 2052))
        data = generate_input(Shape(3, lens), seed=s, device=dev)
        cache, idx, ptr = paged_pool({"bf16": data[1]["bf16"].cpu()}, lens, 1, "bf16", s)
        steps.append((data[0], cache.to(dev), idx.to(dev), ptr.to(dev),
                      torch.tensor(lens, dtype=torch.int32, device=dev)))
    buf = _ServerBuffers(steps, dev)
    disp = Dispatcher([], dev)
    viewed = MLADecodeWrapper("bf16", 16, 1, 1, dev, dispatcher=disp)
    fresh = MLADecodeWrapper("bf16", 16, 1, 1, dev, dispatcher=disp)
    buckets = []
    for s in range(5):
        pages = buf.write(s)
        viewed.plan(buf.qo, buf.ptr, pages, buf.lens, check=False)
        got = viewed.run(buf.q, buf.pool).clone()
        fresh.plan(buf.qo.clone(), buf.ptr.clone(), pages.clone(), buf.lens.clone(),
                   check=False)
        assert viewed.bucket == fresh.bucket
        assert torch.equal(got, fresh.run(buf.q, buf.pool))
        buckets.append(viewed.bucket.kv_hi)
    assert buckets == [2048, 2048, 2048, 4096, 4096]
