"""Why a call of an exported submission can time slower in the GPU MODE harness's
`leaderboard` mode than in its `benchmark` mode: the same call timed under protocols that
differ in one thing each.

Runs in the folder bench/gpumode_harness.sh prepares (the file as `submission.py`, the
harness's `utils.py`, bench/gpumode_reference.py as `reference.py`), where mla_tune is not
importable:

    python3 probe.py OUT_DIR BATCHxKV:SEED [BATCHxKV:SEED ...]

Every timed call is timed as the harness's eval.py times one: synchronize, its L2 clear
(`utils.clear_l2_cache_large`), a CUDA event, `custom_kernel(data)`, a CUDA event,
synchronize. The protocols, `RUNS` calls each after the spec's first (untimed) call:
- benchmark: one input for every call (eval.py's `benchmark` mode);
- leaderboard: a new input drawn before, and checked after, every call (its `leaderboard`
  mode: `generate_input` with the seed moved by 13, a clone, the reference check);
- pool: a new input per call from `POOL` drawn ahead of the timing: new addresses, no
  other kernel between two calls;
- checked: one input, the reference check run after every call: the other kernels between
  two calls, the same addresses.
Each reports the mean, median and minimum time, the host time of `custom_kernel`, and how
many calls found the L2 clear already done on the GPU when `custom_kernel` returned (then
the GPU waited for the launches and host time is inside the timed region). `profile`
gives the kernels' own GPU durations (torch.profiler) for a few calls of the benchmark and
leaderboard protocols. Where the route has a second-launch merge, its variant is also
timed rebuilt with the merge as a plain launch instead of a programmatic dependent one
(`nopdl`) and with the merge fused into the split kernel (`fused`, fast mode), under both
protocols. Lines go to stdout and everything to OUT_DIR/probe.json.
"""

import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import submission
import torch
from reference import check_implementation, generate_input
from utils import clear_l2_cache_large

RUNS = 30
POOL = 6
PROFILED = 5


def _clone(data):
    """eval.py's `_clone_data`: every tensor of the tuple cloned."""
    if isinstance(data, tuple):
        return tuple(_clone(x) for x in data)
    if isinstance(data, list):
        return [_clone(x) for x in data]
    if isinstance(data, dict):
        return {k: _clone(v) for k, v in data.items()}
    return data.clone() if isinstance(data, torch.Tensor) else data


def _timed(fn, data):
    """One call timed as eval.py does: (ns, host ns of the call, whether the GPU had
    already reached the start event when the call returned, the output)."""
    torch.cuda.synchronize()
    clear_l2_cache_large()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    h0 = time.perf_counter_ns()
    out = fn(data)
    host = time.perf_counter_ns() - h0
    waited = start.query()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e6, host, waited, out


def _check(data, out) -> None:
    good, message = check_implementation(data, out)
    if not good:
        raise SystemExit(f"the submission's output failed the check: {message}")


def _protocol(name: str, fn, args: dict, pool: list) -> dict:
    """RUNS timed calls of `fn` under protocol `name` (module docstring)."""
    args = dict(args)
    data = generate_input(**args)
    fixed_copy = _clone(data)
    _check(fixed_copy, fn(data))
    times, hosts, waited = [], [], 0
    for i in range(RUNS):
        check_copy = fixed_copy
        if name == "leaderboard":
            args["seed"] += 13
            data = generate_input(**args)
            check_copy = _clone(data)
        elif name == "pool":
            data, check_copy = pool[i % len(pool)]
        ns, host, early, out = _timed(fn, data)
        if name in ("leaderboard", "checked"):
            _check(check_copy, out)
        del out
        times.append(ns / 1000)
        hosts.append(host / 1000)
        waited += bool(early)
    return {"mean_us": statistics.fmean(times), "median_us": statistics.median(times),
            "min_us": min(times), "std_us": statistics.stdev(times),
            "host_us": statistics.fmean(hosts), "gpu_waited": waited, "runs": RUNS}


def _profile(fn, args: dict, leaderboard: bool) -> dict:
    """Mean GPU durations of the route's kernels over PROFILED calls, from the profiler's
    trace: each kernel's own time, and from the split kernel's start to the last of the
    call's kernels' end."""
    from torch.profiler import ProfilerActivity, profile

    args = dict(args)
    data = generate_input(**args)
    fn(data)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED):
            if leaderboard:
                args["seed"] += 13
                data = generate_input(**args)
                check_copy = _clone(data)
            _, _, _, out = _timed(fn, data)
            if leaderboard:
                _check(check_copy, out)
    trace = Path(f"/tmp/probe_trace_{time.perf_counter_ns()}.json")
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"]
              if e.get("cat") == "kernel"]
    events.sort(key=lambda e: e["ts"])
    calls, own = [], {}
    for i, e in enumerate(events):
        name = e["name"]
        if "mla_" not in name:
            continue
        own.setdefault(name, []).append(e["dur"])
        if "mla_decode_kernel" in name:
            tail = e
            for f in events[i + 1:]:
                if "mla_" not in f["name"] or "mla_decode_kernel" in f["name"]:
                    break
                tail = f
            calls.append(tail["ts"] + tail["dur"] - e["ts"])
    return {"kernels_us": {k: statistics.fmean(v) for k, v in own.items()},
            "split_start_to_end_us": statistics.fmean(calls) if calls else math.nan,
            "calls": len(calls)}


def _variant(spec: tuple[int, int], **change):
    """The spec's routed Triton variant with KernelConfig fields `change`d, as a call, or
    None when the route has no second-launch merge (or is not a Triton variant)."""
    batch, kv = spec
    r = submission._router
    fmt = r.choose_format(batch, (kv,) * batch, 1, 16, ["bf16", "fp8", "mxfp4"])
    _, config, _ = r.decisions(fmt, batch, (kv,) * batch, 1, 16)[0]
    if config is None or config["fast_mode"] or int(config["num_splits"]) == 1:
        return None
    cfg = submission.variant_config(fmt, 1, config)
    if not set(change) <= {f.name for f in dataclasses.fields(cfg)}:
        return None
    launcher = submission.MlaDecodeLauncher(dataclasses.replace(cfg, **change), heads=16,
                                            q_len=1, kv_lens=[kv] * batch, device=r.device,
                                            sm_scale=1.0 / math.sqrt(576))
    launcher.prepare()

    def run(data):
        entry = data[1][fmt]
        if fmt == "bf16":
            return launcher(data[0], entry, None, None, data[2], data[3])
        return launcher(data[0], entry[0], entry[1], None, data[2], data[3])

    return run


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir = Path(sys.argv[1])
    report = {}
    for text in sys.argv[2:]:
        dims, _, seed = text.partition(":")
        batch, kv = (int(x) for x in dims.split("x"))
        args = {"batchsize": batch, "qseqlen": 1, "kvseqlen": kv, "seed": int(seed)}
        pool = []
        for k in range(POOL):
            d = generate_input(**{**args, "seed": args["seed"] + 1000 + k})
            pool.append((d, _clone(d)))
        row = {}
        for name in ("benchmark", "leaderboard", "pool", "checked"):
            row[name] = _protocol(name, submission.custom_kernel, args, pool)
        for label, change in (("nopdl", {"pdl": False}), ("fused", {"fast_mode": True})):
            alt = _variant((batch, kv), **change)
            if alt is not None:
                for name in ("benchmark", "leaderboard"):
                    row[f"{label}-{name}"] = _protocol(name, alt, args, pool)
        for name, lb in (("profile-benchmark", False), ("profile-leaderboard", True)):
            try:
                row[name] = _profile(submission.custom_kernel, args, lb)
            except Exception as e:  # noqa: BLE001 - the timings above still count
                row[name] = {"error": f"{type(e).__name__}: {e}"}
        report[dims] = row
        for name, r in row.items():
            print(f"{dims} {name}: " + ", ".join(
                f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in r.items()), flush=True)
        del pool
    (out_dir / "probe.json").write_text(json.dumps(report, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
