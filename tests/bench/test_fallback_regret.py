"""bench/fallback_regret.py's leave-one-out tables and its stand-in for the routing rules
before the row model, on CPU (the timing itself needs a GPU and is not tested here)."""

from __future__ import annotations

import math

import fallback_regret
import pytest

from mla_tune.problem.shapes import Shape
from mla_tune.runtime.dispatcher import Dispatcher
from mla_tune.runtime.routing_rules import occupancy_splits
from tests.runtime.test_dispatcher import (  # noqa: F401
    SWEPT_Q1H16,
    _as_h200,
    _triton_winner,
    standin,
)

CPU = "cpu"


def test_a_held_out_shape_leaves_no_trace_in_the_table(standin) -> None:  # noqa: F811
    a, b, c = Shape.uniform(2, 256), Shape.uniform(4, 256), Shape.uniform(2, 256, heads=32)
    table = [_triton_winner(a, SWEPT_Q1H16, 10.0, ok=(b,)),
             _triton_winner(b, dict(SWEPT_Q1H16, num_splits=2), 12.0, wrong=(a, c)),
             _triton_winner(c, dict(SWEPT_Q1H16, num_splits=1), 14.0, ok=(a,))]
    left = fallback_regret.without(table, lambda s: s.key == a.key)
    assert [r.shape for r in left] == [b, c]
    assert left[0].verified_wrong == (c,) and left[1].verified_ok == ()
    fam = fallback_regret.without(table, lambda s: fallback_regret.family(s)
                                  == fallback_regret.family(a))
    assert [r.shape for r in fam] == [c]


def test_the_previous_rule_is_the_nearest_variant_as_tuned_else_16_row_blocks(
        standin) -> None:  # noqa: F811
    tuned, call = Shape.uniform(32, 1024), Shape.uniform(4, 1024)
    d = _as_h200(Dispatcher([_triton_winner(tuned, SWEPT_Q1H16, 25.0)], CPU))
    chain = d.decisions(call)
    assert chain[0].config != SWEPT_Q1H16  # the row model re-derived the splits
    assert fallback_regret.previous_rule(chain, call, d.device, 132) == ("triton",
                                                                         SWEPT_Q1H16)
    wide = Shape.uniform(2, 256, q_len=4, heads=32)
    backend, config = fallback_regret.previous_rule(d.decisions(wide), wide, d.device, 132)
    want = occupancy_splits(2, 128, 256, 132)  # over 16-row blocks
    splits = {c["num_splits"] for c in standin.candidates(wide, d.device)
              if c["block_m"] == 16 and c["num_splits"]}
    assert (backend, config["block_m"]) == ("triton", 16)
    assert config["num_splits"] == min(splits, key=lambda n: abs(math.log2(n / want)))


def test_the_summary_gives_each_family_its_median_and_worst() -> None:
    rows = [{"family": "bf16 h32 q4", "regret": v} for v in (1.0, 1.2, 1.1)]
    rows += [{"family": "fp8 h16 q1", "regret": 1.05}, {"family": "fp8 h16 q1",
                                                        "regret": None}]
    lines = fallback_regret.summary_lines(rows, "regret")
    assert "| bf16 h32 q4 | 3 | 1.10x | 1.20x | 1.20x |" in lines
    assert "| fp8 h16 q1 | 1 | 1.05x | 1.05x | 1.05x |" in lines
    assert lines[-1] == "| **all** | 4 | 1.08x | 1.20x | 1.20x |"


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
