"""Per-call host overhead of `mla_tune.Dispatcher` over calling the winning kernel directly,
and a CUDA-graph capture of a dispatched call.

Self-contained: unless `--winners FILE` is given it tunes the shape in-process (the real
sweep, a small random budget, a temporary SQLite DB), exports the winners JSON, and loads
the Dispatcher from that file, as a submission would (if tuning fails, the dispatcher's
heuristic variant is measured instead, and the report says so). Then, with blocks of calls
of each path interleaved (synchronizing between blocks, outside the timed region, so the
launch queue never fills):
- host time per call: `perf_counter_ns` around `dispatcher.run(data)` (with and without
  `check_inputs`) vs around the same variant's kernel function built directly
  (`backend.build(...)`), median of all calls;
- the dispatcher's machinery alone: the same measurement with a no-op kernel (a backend
  whose variant returns a preallocated tensor), which isolates lookup + input checks;
- device time with the leaderboard's protocol (cold L2, CUDA events) for both paths;
- a CUDA graph captured around `dispatcher.run(data)`: replay must equal the eager call,
  also after new inputs are copied into the captured input tensors.

    source .device/setup.sh && python3 bench/dispatch_overhead.py --out result.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import benchkit
from mla_tune.backends import get_backend, register
from mla_tune.backends.base import Availability, Backend, KernelFn
from mla_tune.machine.fingerprint import current_device, current_software
from mla_tune.problem.shapes import Shape, TaskInput
from mla_tune.results.winner import Winner
from mla_tune.runtime.dispatcher import Dispatcher
from mla_tune.tuning.space import ParamSpace
from mla_tune.tuning.timing import CudaTimer, TimingPolicy


class NoopBackend(Backend):
    """A variant that launches nothing: calling it through the dispatcher measures the
    dispatcher alone."""

    name = "bench-noop"

    def available(self, device: torch.device) -> Availability:
        return Availability(True)

    def declared_space(self, device: torch.device) -> ParamSpace:
        return ParamSpace.from_mapping({"variant": [0]})

    def build(self, shape: Shape, config: Any, device: torch.device) -> KernelFn:
        out = torch.empty((shape.total_q, shape.heads, 512), dtype=torch.bfloat16,
                          device=device)
        return lambda data: out

    def source_files(self) -> list[Path]:
        return [Path(__file__)]


def tune(shape: Shape, backend: str, budget: int, device: str, path: Path) -> None:
    """Sweep `shape` into a temporary DB and export its winners to `path`."""
    from mla_tune.db import TuningStore
    from mla_tune.results.winners_file import export_winners
    from mla_tune.tuning.search import Strategy
    from mla_tune.tuning.sweep import SweepOptions, run_sweep

    with tempfile.TemporaryDirectory() as tmp:
        with TuningStore(str(Path(tmp) / "tuning.db")) as store:
            options = SweepOptions(devices=(device,), strategy=Strategy.RANDOM, budget=budget,
                                   policy=TimingPolicy(budget_s=0.2), baselines=False)
            t0 = time.perf_counter()
            (result,) = run_sweep([shape], [get_backend(backend)], store, options)
            print(f"tuned {shape.key} with {backend} ({budget} configs) in "
                  f"{time.perf_counter() - t0:.0f} s; winner: "
                  f"{result.winner.config if result.winner else None}", file=sys.stderr)
            export_winners(store, path, device_hash=current_device(device).hash)


def host_ns(paths: dict[str, Callable[[TaskInput], Any]], data: TaskInput, blocks: int,
            per_block: int) -> dict[str, list[int]]:
    """Host nanoseconds per call of each path, blocks interleaved across paths."""
    clock = time.perf_counter_ns
    samples: dict[str, list[int]] = {name: [] for name in paths}
    for _ in range(blocks):
        for name, fn in paths.items():
            out = samples[name]
            torch.cuda.synchronize()
            for _ in range(per_block):
                t0 = clock()
                fn(data)
                out.append(clock() - t0)
    torch.cuda.synchronize()
    return samples


def describe(ns: list[int]) -> str:
    q = statistics.quantiles(ns, n=10)
    return (f"median {statistics.median(ns) / 1e3:.2f} us, p10 {q[0] / 1e3:.2f}, "
            f"p90 {q[-1] / 1e3:.2f}, n {len(ns)}")


def graph_check(dispatcher: Dispatcher, data: TaskInput, shape: Shape) -> list[str]:
    """Capture `dispatcher.run(data)` in a CUDA graph; replay must equal eager calls."""
    eager = dispatcher.run(data).clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            dispatcher.run(data)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = dispatcher.run(data)
    graph.replay()
    torch.cuda.synchronize()
    lines = [f"- replay vs eager, same inputs: equal={torch.equal(static_out, eager)}, "
             f"max abs diff {(static_out.float() - eager.float()).abs().max().item():.3g}"]
    fresh = benchkit.task_input(shape, data[0].device, seed=1)
    data[0].copy_(fresh[0])
    data[1][shape.kv_format.value].copy_(fresh[1][shape.kv_format.value])
    graph.replay()
    torch.cuda.synchronize()
    replayed = static_out.clone()
    again = dispatcher.run(data).clone()
    lines.append(f"- replay vs eager, new inputs copied into the captured tensors: "
                 f"equal={torch.equal(replayed, again)}, changed from before: "
                 f"{not torch.equal(replayed, eager)}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--kv", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-format", default="bf16", choices=["bf16"])
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--budget", type=int, default=8, help="configs measured when tuning")
    ap.add_argument("--winners", type=Path, help="use this winners JSON instead of tuning")
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--per-block", type=int, default=250)
    ap.add_argument("--out", type=Path, help="also write the report here (markdown)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU")
    device = f"cuda:{torch.cuda.current_device()}"
    shape = Shape.uniform(args.batch, args.kv, heads=args.heads, kv_format=args.kv_format)

    with tempfile.TemporaryDirectory() as tmp:
        winners = args.winners or Path(tmp) / "winners.json"
        if args.winners is None:
            try:
                tune(shape, args.backend, args.budget, device, winners)
            except Exception as e:  # noqa: BLE001 - the overhead is still measurable
                print(f"tuning failed ({type(e).__name__}: {e}); the dispatcher routes by "
                      "its heuristics", file=sys.stderr)
        dispatcher = Dispatcher.from_json(winners, device, kv_format=args.kv_format)
        unchecked = Dispatcher.from_json(winners, device, kv_format=args.kv_format,
                                         check_inputs=False)
    decision = dispatcher.decide(shape)
    direct = get_backend(decision.backend).build(shape, decision.config, torch.device(device))
    data = benchkit.task_input(shape, device)
    dispatcher.run(data)  # route and build once, outside any measurement
    unchecked.run(data)
    direct(data)

    register(NoopBackend.name, f"{__name__}:NoopBackend")
    fp = current_device(device)
    noop_record = Winner(device=fp, software=current_software(), shape=shape,
                         backend=NoopBackend.name,
                         source_hash=get_backend(NoopBackend.name).source_hash(),
                         config={"variant": 0}, median_us=1.0)
    noop_dispatcher = Dispatcher([noop_record], device, kv_format=args.kv_format)
    noop_unchecked = Dispatcher([noop_record], device, kv_format=args.kv_format,
                                check_inputs=False)
    noop_direct = get_backend(NoopBackend.name).build(shape, {"variant": 0},
                                                      torch.device(device))
    noop_dispatcher.run(data)
    noop_unchecked.run(data)

    paths = {"direct": direct, "dispatcher": dispatcher.run, "unchecked": unchecked.run,
             "noop direct": noop_direct, "noop dispatcher": noop_dispatcher.run,
             "noop unchecked": noop_unchecked.run}
    host_ns(paths, data, 2, args.per_block)  # warm-up
    ns = host_ns(paths, data, args.blocks, args.per_block)
    med = {k: statistics.median(v) / 1e3 for k, v in ns.items()}

    timer = CudaTimer(torch.device(device), TimingPolicy(budget_s=1.0))
    dev_direct = timer.measure(lambda: direct(data))
    dev_disp = timer.measure(lambda: dispatcher.run(data))

    props = torch.cuda.get_device_properties(0)
    lines = [
        f"# Dispatcher overhead, {shape.label()} ({time.strftime('%Y-%m-%d')})",
        "",
        f"- device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}"
        f"; software {dict(current_software().versions)}",
        f"- table: {dispatcher.summary()}",
        f"- routed: {decision.describe()}",
        "",
        "## Host time per call (perf_counter_ns around each call, blocks interleaved)",
        "",
        *(f"- {k}: {describe(v)}" for k, v in ns.items()),
        "",
        f"- **added by the dispatcher (real kernel): {med['dispatcher'] - med['direct']:.2f} us"
        f" per call, ratio {med['dispatcher'] / med['direct']:.3f}**",
        f"- with check_inputs=False (real kernel): "
        f"{med['unchecked'] - med['direct']:.2f} us per call, ratio "
        f"{med['unchecked'] / med['direct']:.3f}",
        f"- dispatcher machinery alone (no-op kernel): "
        f"{med['noop dispatcher'] - med['noop direct']:.2f} us per call; with "
        f"check_inputs=False {med['noop unchecked'] - med['noop direct']:.2f} us",
        "",
        "## Device time per call (cold L2, CUDA events, leaderboard protocol)",
        "",
        f"- direct: median {dev_direct.median_us:.2f} us, mean {dev_direct.mean_us:.2f} "
        f"(n {dev_direct.n})",
        f"- dispatcher: median {dev_disp.median_us:.2f} us, mean {dev_disp.mean_us:.2f} "
        f"(n {dev_disp.n})",
        "",
        "## CUDA graph capture of dispatcher.run(data)",
        "",
        *graph_check(dispatcher, data, shape),
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
