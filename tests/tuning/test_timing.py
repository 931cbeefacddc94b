import math
import time

import pytest

from mla_tune.tuning.timing import (
    NOTHING,
    OTHER_KERNELS,
    CudaTimer,
    OtherKernels,
    TimingPolicy,
    WallTimer,
    make_timer,
    summarize,
)


def test_summarize_statistics():
    s = summarize([1.0, 2.0, 3.0, 4.0, 10.0])
    assert s.median_us == 3.0 and s.mean_us == 4.0 and s.min_us == 1.0 and s.max_us == 10.0
    assert s.n == 5
    assert s.std_us == pytest.approx(math.sqrt(sum((x - 4) ** 2 for x in [1, 2, 3, 4, 10]) / 4))
    assert s.rse == pytest.approx(s.std_us / math.sqrt(5) / 4.0)
    with pytest.raises(ValueError):
        summarize([])


def test_policy_stops_on_low_error_after_min_runs():
    p = TimingPolicy(min_runs=5, max_runs=100, target_rse=0.01, budget_s=10)
    assert not p.done([1.0] * 4, 0.0)
    assert p.done([1.0] * 5, 0.0)
    assert not p.done([1.0, 2.0] * 3, 0.0)  # rse too high, budget left
    assert p.done([1.0, 2.0] * 3, 10.0)  # budget spent


def test_policy_caps_runs():
    p = TimingPolicy(min_runs=2, max_runs=7, target_rse=0.0, budget_s=100)
    assert p.done([1.0, 2.0] * 4, 0.0)


def test_wall_timer_measures_real_time():
    import time

    timer = make_timer("cpu", TimingPolicy(warmup=1, min_runs=5, max_runs=5, budget_s=5))
    assert isinstance(timer, WallTimer)
    calls = []
    stats = timer.measure(lambda: (calls.append(1), time.sleep(0.002)))
    assert stats.n == 5 and len(calls) == 6  # warm-up call is not timed
    assert 2000 <= stats.min_us < 50000


def test_interleaved_timing_takes_blocks_of_each_in_turn():
    from mla_tune.tuning.timing import INTERLEAVE_BLOCK as B

    calls: list[str] = []
    timer = WallTimer(TimingPolicy(warmup=1, min_runs=5, max_runs=2 * B, budget_s=10.0,
                                   target_rse=0.0))
    fast, slow = (lambda: calls.append("a")), (lambda: (calls.append("b"), time.sleep(0.002)))
    a, b = timer.measure_interleaved([fast, slow])
    assert calls[:2] == ["a", "b"]  # the warm-up calls
    # Then in turn, one untimed and B timed calls of each, until each has max_runs.
    assert calls[2:] == (["a"] * (B + 1) + ["b"] * (B + 1)) * 2
    assert a.n == b.n == 2 * B
    assert b.median_us > 2000 > a.median_us


def test_a_single_callable_is_timed_call_by_call():
    calls: list[str] = []
    timer = WallTimer(TimingPolicy(warmup=2, min_runs=3, max_runs=3, target_rse=0.0))
    assert timer.measure(lambda: calls.append("a")).n == 3
    assert len(calls) == 5


def test_policy_names_what_runs_between_calls():
    assert TimingPolicy().between_calls == OTHER_KERNELS  # the leaderboard's condition
    assert TimingPolicy(between_calls=NOTHING).between_calls == NOTHING
    with pytest.raises(ValueError, match="between_calls must be one of"):
        TimingPolicy(between_calls="sleep")


def test_other_kernels_work_on_their_own_buffers():
    import torch

    work = OtherKernels(torch.device("cpu"))
    before = work.draw.clone()
    ptrs = [t.data_ptr() for t in (work.draw, work.prod, work.diff, work.bad)]
    work()
    assert not torch.equal(before, work.draw)  # a new draw each call
    assert work.bad.item() == pytest.approx((work.a @ work.a - work.a).abs().max().item())
    assert [t.data_ptr() for t in (work.draw, work.prod, work.diff, work.bad)] == ptrs


def test_cuda_timer_runs_other_kernels_before_each_timed_call():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("CudaTimer needs a CUDA GPU")
    order: list[str] = []
    for between, want in ((OTHER_KERNELS, ["other", "call"] * 3), (NOTHING, ["call"] * 3)):
        order.clear()
        timer = CudaTimer(torch.device("cuda"), TimingPolicy(warmup=0, min_runs=3, max_runs=3,
                                                             between_calls=between))
        if timer._between is not None:
            real = timer._between
            timer._between = lambda real=real: (order.append("other"), real())
        timer.measure(lambda: order.append("call"))
        assert order == want
