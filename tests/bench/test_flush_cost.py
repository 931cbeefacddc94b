"""bench/flush_cost.py must measure what the protocol's flush costs: on a GPU, a read larger
than L2 is slower after the protocol's write flush than after the clean one (a clean flush
that left dirty lines behind would show no difference); without one, the script says so
and exits non-zero instead of printing CPU figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.compiled_child import run_compiled

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine "
                    "without a GPU")
def test_refuses_without_a_gpu() -> None:
    proc = run_compiled([str(ROOT / "bench" / "flush_cost.py"), "--mb", "1"], timeout=120)
    assert proc.returncode != 0
    assert "no CUDA device" in proc.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times an L2 flush: needs a GPU")
def test_write_flush_costs_a_large_read_its_write_back() -> None:
    import flush_cost

    from mla_tune.tuning.timing import CudaTimer, TimingPolicy

    dev = torch.device("cuda")
    policy = TimingPolicy(warmup=2, min_runs=20, max_runs=50, budget_s=0.2)
    write, clean = CudaTimer(dev, policy), flush_cost.CleanFlushTimer(dev, policy)
    x = torch.ones(write.flush_bytes // 4, dtype=torch.float32, device=dev)
    w, c = flush_cost.time_read(x, write), flush_cost.time_read(x, clean)
    assert w > c + 1.0, (w, c)
    assert flush_cost.time_empty(write, dev) < c
