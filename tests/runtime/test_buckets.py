"""Length buckets and ragged task tuples routed without kv_lens (CPU: the torch family's
bucket build; the Triton one runs in tests/runtime/test_wrapper.py under the interpreter,
and here after a real ragged Triton sweep, in a child process: this file run as a
script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mla_tune.backends import get_backend
from mla_tune.backends.triton_family import TritonFamily
from mla_tune.machine.fingerprint import current_device, current_software
from mla_tune.problem.reference import mla_decode_reference
from mla_tune.problem.shapes import KVFormat, Shape, generate_input
from mla_tune.results.winner import Winner
from mla_tune.runtime.buckets import (
    Bucket,
    BucketEdges,
    bucket_config,
    bucket_of,
    router_for,
)
from mla_tune.runtime.bucket_rules import winner_pages
from mla_tune.runtime.dispatcher import Dispatcher
from mla_tune.tuning.space import ParamSpace

ROOT = Path(__file__).resolve().parents[2]

GATE = 2e-2


def err(out: torch.Tensor, data, fmt: str = "bf16") -> float:
    return float((out.float() - mla_decode_reference(*data, kv_format=fmt)).abs().max())


def record(shape: Shape, config: dict, median_us: float = 10.0) -> Winner:
    """A torch-family winner of this machine and sources (as a sweep here would store)."""
    torch_family = get_backend("torch")
    return Winner(current_device("cpu"), current_software(), shape, "torch",
                  torch_family.source_hash(), config, median_us)


TORCH_CFG = {"num_splits": 1, "chunk_size": 0, "compute_dtype": "float32"}


def test_kv_classes_are_log_scale_and_configurable(monkeypatch) -> None:
    edges = BucketEdges()
    assert edges.kv_class(4096) == (2048, 4096)  # an edge belongs to the class below it
    assert edges.kv_class(4097) == (4096, 8192)
    assert edges.kv_class(1) == (0, 64)
    assert edges.kv_class(3 * 2 ** 20) == (2 ** 21, 2 ** 22)  # past the last edge: doubling
    custom = BucketEdges.parse("100, 1000,10000")
    assert custom.kv_class(999) == (100, 1000) and custom.kv_class(20000) == (10000, 20000)
    monkeypatch.setenv("MLA_TUNE_KV_BUCKETS", "300,3000")
    assert BucketEdges.from_env().kv == (300, 3000)
    for bad in ("3000,300", "a,b", "0,10", ""):
        with pytest.raises(ValueError):
            BucketEdges.parse(bad) if bad else BucketEdges(())


def test_bucket_of_uses_the_mean_and_a_middle_representative() -> None:
    s = Shape(4, (300, 8000, 5000, 2000), kv_format="fp8")  # mean 3825
    b = bucket_of(s)
    assert (b.batch, b.kv_lo, b.kv_hi, b.kv_format) == (4, 2048, 4096, KVFormat.FP8)
    rep = b.representative()
    assert not rep.is_ragged and rep.batch == 4 and 2048 < rep.kv_len <= 4096
    assert rep.kv_format is KVFormat.FP8


def test_bucket_config_makes_tuned_configs_length_independent() -> None:
    """'tma_host' runs as per-program descriptors (on a page pool too: the runner picks
    TMA or pointer loads by page size), the page-size knob is 1, other knobs stay."""
    tuned = {"kv_load": "tma_host", "page_size": 1, "num_splits": 8}
    assert bucket_config("triton", tuned)["kv_load"] == "tma"
    assert bucket_config("triton", {"kv_load": "pointer", "page_size": 16})["page_size"] == 1
    assert bucket_config("torch", TORCH_CFG) == TORCH_CFG
    assert bucket_config("flashinfer", {"page_size": 64}) is None
    assert bucket_config("triton", {**tuned, "seg_cost": 4})["seg_cost"] == 4
    assert winner_pages(64) == (64, 1) and winner_pages(1) == (1,)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("q_len", [1, 4])
def test_ragged_task_tuple_without_kv_lens(fmt: str, q_len: int) -> None:
    d = Dispatcher([], "cpu", kv_format=fmt)
    data = generate_input(Shape(3, (37, 128, 70), q_len=q_len), seed=3)
    assert err(d.run(data), data, fmt) < GATE
    assert router_for(d).builds == 1


def test_custom_kernel_takes_ragged_task_tuples() -> None:
    from mla_tune.runtime import submission

    data = generate_input(Shape(2, (90, 41)), seed=4, device=submission.dispatcher.device)
    assert err(submission.custom_kernel(data), data) < GATE


@pytest.mark.parametrize("check_inputs", [True, False])
def test_growing_loop_builds_once_per_bucket(check_inputs: bool, monkeypatch) -> None:
    # One variant for both classes whatever the machine: without a tuned shape the row
    # model picks splits from the core count, which may differ between the two classes.
    monkeypatch.setenv("MLA_TUNE_FORCE", "torch:num_splits=1")
    d = Dispatcher([], "cpu", kv_format="bf16", check_inputs=check_inputs)
    router = router_for(d)
    lens = [70, 90, 100]  # mean 86..95: one bucket, (64, 128]
    for step in range(8):
        data = generate_input(Shape(3, tuple(L + step for L in lens)), seed=step)
        out = d.run(data)
        if step in (0, 7):
            assert err(out, data) < GATE
        assert router.builds == 1
    # The next class routes to the same variant here: its runner is shared, not rebuilt.
    data = generate_input(Shape(3, (150, 160, 170)), seed=9)
    assert err(d.run(data), data) < GATE and router.builds == 1
    assert len({id(r) for r in router._runners.values()}) == 1


def test_kv_lens_calls_share_the_bucket_runner_and_are_checked() -> None:
    d = Dispatcher([], "cpu", kv_format="bf16")
    lens = (40, 77, 63)
    data = generate_input(Shape(3, lens), seed=5)
    assert err(d.run(data, kv_lens=list(lens)), data) < GATE
    assert err(d.run(data), data) < GATE
    assert router_for(d).builds == 1
    with pytest.raises(ValueError, match="sum to"):
        d.run(data, kv_lens=[40, 77, 62])
    with pytest.raises(ValueError, match="lengths for batch_size"):
        d.run(data, kv_lens=[40, 77])


@pytest.mark.parametrize("kv_max", [20, 80])
def test_rows_no_ragged_batch_can_hold_are_refused(kv_max: int) -> None:
    """80 rows cannot be 2 sequences of at most 20 tokens, nor a longest one of 80 and
    another of at least one token (81 rows): checked as a uniform call, refused naming
    the KV."""
    d = Dispatcher([], "cpu", kv_format="bf16")
    q, kv, qo, kvp, config = generate_input(Shape(2, (30, 50)), seed=6)
    with pytest.raises(ValueError, match=r"kv_data\['bf16'\] has shape"):
        d.run((q, kv, qo, kvp, dict(config, kv_seq_len=kv_max)))
    assert router_for(d).builds == 0


def test_exact_tuned_shape_still_wins_and_buckets_route_by_mean() -> None:
    near = Shape.uniform(2, 64)
    far = Shape.uniform(2, 2048)
    d = Dispatcher([record(near, dict(TORCH_CFG, num_splits=4)),
                    record(far, dict(TORCH_CFG, chunk_size=256))], "cpu", kv_format="bf16")
    uniform = generate_input(near, seed=1)
    assert err(d.run(uniform), uniform) < GATE
    assert router_for(d).builds == 0  # the exact route, not a bucket
    # Longest 1500 (nearer 2048 by the max) but mean ~780: the bucket goes by the mean.
    bucket = router_for(d).bucket(2, 1560, 1, 16, KVFormat.BF16)
    first = router_for(d).decisions(bucket, paged=False)[0]
    assert first.reason == "nearest" and first.tuned_shape == far
    small = router_for(d).decisions(router_for(d).bucket(2, 150, 1, 16, KVFormat.BF16),
                                    paged=False)[0]
    assert small.tuned_shape == near and small.config["num_splits"] == 4


def test_a_winner_tuned_on_a_ragged_batch_routes_its_bucket() -> None:
    ragged = Shape(2, (100, 400))
    d = Dispatcher([record(Shape.uniform(2, 256), TORCH_CFG),
                    record(ragged, dict(TORCH_CFG, compute_dtype="bfloat16"))], "cpu",
                   kv_format="bf16")
    b = bucket_of(ragged)
    assert isinstance(b, Bucket) and router_for(d).has_ragged_winners
    first = router_for(d).decisions(b, paged=False)[0]
    assert first.reason == "exact" and first.config["compute_dtype"] == "bfloat16"
    data = generate_input(Shape(2, (120, 390)), seed=2)
    assert err(d.run(data), data) < GATE


def test_force_and_trace_apply_to_buckets(monkeypatch, capsys) -> None:
    monkeypatch.setenv("MLA_TUNE_FORCE", "torch:num_splits=4")
    monkeypatch.setenv("MLA_TUNE_TRACE", "1")
    d = Dispatcher([], "cpu", kv_format="bf16")
    data = generate_input(Shape(2, (120, 200)), seed=7)
    assert err(d.run(data), data) < GATE
    (runner,) = {id(r): r for r in router_for(d)._runners.values()}.values()
    assert runner.decision.reason == "forced" and runner.decision.config["num_splits"] == 4
    trace = capsys.readouterr().err
    assert "mla-tune route:" in trace and "[forced] bucket 2x(128,256]" in trace


def test_bucket_routing_is_the_same_on_every_rank() -> None:
    table = [record(Shape.uniform(2, 64), dict(TORCH_CFG, num_splits=4)),
             record(Shape.uniform(8, 1024), TORCH_CFG)]
    a, b = (Dispatcher(table, "cpu", kv_format="bf16") for _ in range(2))
    buckets = [router_for(a).bucket(bt, bt * kv, 1, 16, KVFormat.BF16)
               for bt in (1, 3, 8) for kv in (40, 700, 5000)]
    assert [router_for(a).decisions(x, paged=p) for x in buckets for p in (False, True)] == \
        [router_for(b).decisions(x, paged=p) for x in buckets for p in (False, True)]


def test_later_ragged_calls_are_checked_before_the_kernel() -> None:
    d = Dispatcher([], "cpu", kv_format="bf16")
    q, kv, qo, kvp, config = generate_input(Shape(2, (60, 90)), seed=3)
    d.run((q, kv, qo, kvp, config))
    strided = torch.empty((150, 2, 576), dtype=torch.bfloat16)[:, :1]
    strided.copy_(kv["bf16"])
    for bad in ((q, dict(kv, bf16=strided), qo, kvp, config),
                (q, dict(kv, bf16=kv["bf16"].float()), qo, kvp, config),
                (q[:1], kv, qo, kvp, config)):
        with pytest.raises(ValueError, match="do not match bucket|q has shape"):
            d.run(bad)


def test_a_paged_bucket_takes_the_contiguous_buckets_ragged_winner() -> None:
    """No ragged winner of its page size: the page-1 bucket's ragged winner, before the
    uniform winners (its own page size's first); with one, that one first."""
    ragged = Shape(2, (100, 400))
    paged_uniform = Shape.uniform(2, 256, page_size=16)
    table = [record(Shape.uniform(2, 200), TORCH_CFG),
             record(paged_uniform, dict(TORCH_CFG, num_splits=4)),
             record(ragged, dict(TORCH_CFG, compute_dtype="bfloat16"))]
    bucket = replace(bucket_of(ragged), page_size=16)
    router = router_for(Dispatcher(table, "cpu", kv_format="bf16"))
    got = router.decisions(bucket, paged=True)
    assert [(d.reason, d.tuned_shape) for d in got[:3]] == [
        ("nearest", ragged), ("nearest", paged_uniform), ("nearest", Shape.uniform(2, 200))]
    assert got[0].config["compute_dtype"] == "bfloat16" and "p1" in got[0].detail
    assert router.runner(bucket, paged=True).decision == got[0]
    assert router.decisions(bucket_of(ragged), paged=False)[0].reason == "exact"
    own = Shape(2, (120, 380), page_size=16)
    assert bucket_of(own) == bucket
    mine = dict(TORCH_CFG, num_splits=4, compute_dtype="bfloat16")
    router = router_for(Dispatcher(table + [record(own, mine)], "cpu", kv_format="bf16"))
    got = router.decisions(bucket, paged=True)
    assert [(d.reason, d.tuned_shape) for d in got[:2]] == [("exact", own), ("nearest", ragged)]


class WideSegCostTriton(TritonFamily):
    """The Triton family with this test's own CPU space: seg_cost 1 or 4 (the declared CPU
    space keeps 1 alone; the interpreter is slow). The same sources and source hash."""

    def declared_space(self, device: torch.device) -> ParamSpace:
        space = super().declared_space(device)
        return ParamSpace(tuple((n, (1, 4) if n == "seg_cost" else c) for n, c in space.params),
                          space.defaults)


def test_a_ragged_triton_sweep_routes_its_bucket_to_the_runner_it_timed(tmp_path) -> None:
    """`mla-tune sweep --shape 3 --ragged ...` on the Triton family (the interpreter) stores
    a winner with seg_cost 4; the dispatcher's bucket router serves another call of that
    bucket with it (built with seg_cost 4), and a paged bucket without a ragged winner of
    its own with the same winner, adapted."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT),
               MLA_TUNE_EXTRA_BACKENDS="triton=tests.runtime.test_buckets:WideSegCostTriton")
    proc = subprocess.run([sys.executable, __file__, str(tmp_path / "t.db")], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["sweep_exit"] == 0, r
    assert r["trial"] == [["ok", 4]] and r["winner_seg_cost"] == 4, r
    assert r["decision"] == ["exact", 4, r["tuned"]], r
    assert r["runner"] == ["triton", "BalancedLauncher", 1, 4] and r["err"] < GATE, r
    assert r["paged_decision"] == ["nearest", 4, r["tuned"]], r
    assert r["paged_runner"] == [2, 4, 16], r


def _child(db: str) -> None:
    """The sweep and the routing checks of the test above, in one interpreter process."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    from typer.testing import CliRunner

    from mla_tune.cli.main import app
    from mla_tune.db import TuningStore
    from mla_tune.problem.shapes import RaggedLengths, parse_ragged_shape

    sweep = CliRunner().invoke(app, [
        "sweep", "--shape", "3", "--ragged", "uniform:40-110", "-f", "bf16", "-b", "triton",
        "--db", db, "--device", "cpu", "--no-baseline", "--runoff", "0",
        "--time-budget", "0.01", "--pin", "triton.seg_cost=4", "--pin", "triton.num_splits=2",
        "--pin", "triton.fast_mode=false"])
    out: dict = {"sweep_exit": sweep.exit_code,
                 "output": sweep.output[-1500:] if sweep.exit_code else ""}
    tuned = parse_ragged_shape("3", RaggedLengths.parse("uniform:40-110"))
    with TuningStore(db) as store:
        trials = store.trials(shape_key=tuned.key, backend="triton")
    out["trial"] = [[t.status, t.config.get("seg_cost")] for t in trials]
    d = Dispatcher.from_db(db, device="cpu", kv_format="bf16")
    out["winner_seg_cost"] = d._table[tuned.key].config["seg_cost"]
    out["tuned"] = tuned.key
    lens = tuple(L + 7 for L in tuned.kv_lens)  # another call of the same bucket
    other = Shape(3, lens)
    assert bucket_of(other) == bucket_of(tuned) and other != tuned
    router = router_for(d)
    first = router.decisions(bucket_of(other), paged=False)[0]
    out["decision"] = [first.reason, first.config["seg_cost"], first.tuned_shape.key]
    data = generate_input(other, seed=3)
    res = d.run(data)
    out["err"] = float((res.float() - mla_decode_reference(*data)).abs().max())
    (runner,) = {id(r): r for r in router._runners.values()}.values()
    launcher = runner.launcher
    out["runner"] = [runner.decision.backend, type(launcher).__name__, launcher.sched,
                     launcher.seg_cost]
    paged = replace(bucket_of(tuned), page_size=16)
    first = router.decisions(paged, paged=True)[0]
    out["paged_decision"] = [first.reason, first.config["seg_cost"], first.tuned_shape.key]
    launcher = router.runner(paged, paged=True).launcher
    out["paged_runner"] = [launcher.sched, launcher.seg_cost, launcher.page_size]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    _child(sys.argv[1])


def test_force_can_pin_a_knob_only_the_bucket_runner_has(monkeypatch) -> None:
    """seg_cost exists only where the balanced schedule runs: the uniform representative's
    candidates leave it out, the bucket's forced route does not."""
    import mla_tune.backends as backends

    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))
    monkeypatch.setattr(backends, "_instances", dict(backends._instances))
    # The Triton family's GPU space and rules, routed on CPU.
    backends.register("triton", "tests.runtime.test_dispatcher:TritonStandIn")
    monkeypatch.setenv("MLA_TUNE_FORCE", "triton:seg_cost=4,num_splits=2")
    d = Dispatcher([], "cpu", kv_format="bf16")
    bucket = bucket_of(Shape(32, tuple(range(3000, 3032))))
    first = router_for(d).decisions(bucket, paged=False)[0]
    assert first.reason == "forced" and first.backend == "triton"
    assert (first.config["seg_cost"], first.config["num_splits"]) == (4, 2)
    assert d._forced(bucket.representative()) is None  # the uniform lookup cannot


def test_route_serving_names_the_bucket_and_what_its_runner_builds(tmp_path,
                                                                   monkeypatch) -> None:
    """`mla-tune route --serving`: the bucket a wrapper's (or ragged task's) call of these
    sizes lands in, by the edges in force, and the ragged winner its runner builds."""
    from typer.testing import CliRunner

    from mla_tune.cli.main import app
    from mla_tune.results.winners_file import write_winners_json

    ragged, paged = Shape(2, (100, 400)), Shape(2, (100, 400), page_size=16)
    path = tmp_path / "w.json"
    write_winners_json([record(ragged, dict(TORCH_CFG, compute_dtype="bfloat16")),
                        record(paged, dict(TORCH_CFG, num_splits=4))], path)
    cli = CliRunner()

    def route(*args: str, size: str = "2x250") -> list[str]:
        r = cli.invoke(app, ["route", "-s", size, "-f", "bf16", "--winners", str(path),
                             "--device", "cpu", "--serving", *args])
        assert r.exit_code == 0, r.output
        return r.stdout.splitlines()

    task, wrapper = route(), route("--page-size", "16")
    assert "bucket 2x(128,256] bf16 h16 q1 p1 (ragged task tuple" in task[2]
    assert "compute_dtype=bfloat16" in task[2] and task[3].startswith("  why: exact")
    assert "bucket 2x(128,256] bf16 h16 q1 p16 (MLADecodeWrapper, pages of 16)" in wrapper[2]
    assert "num_splits=4" in wrapper[2] and wrapper[3].startswith("  why: exact")
    assert route("--page-size", "16", size="2x150")[3].startswith("  why: exact")
    monkeypatch.setenv("MLA_TUNE_KV_BUCKETS", "200,1000")  # now 150 and 250 part
    moved = route("--page-size", "16", size="2x150")
    assert "kv edges 200, 1000" in moved[1] and "bucket 2x(0,200]" in moved[2]
    assert moved[3].startswith("  why: heuristic")  # no winner of that bucket
