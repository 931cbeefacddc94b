"""`mla_tune.submission.custom_kernel`: the leaderboard entry point, checked against the
float32 reference on small shapes, with and without a winners file."""

import importlib

import pytest

from mla_tune.problem.reference import mla_decode_reference
from mla_tune.problem.shapes import Shape, generate_input
from mla_tune.problem.verify import Tolerance, check
from mla_tune.results.winners_file import export_winners
from tests.fixtures.sweep_db import swept_db

# The leaderboard's allclose tolerance, with a few bf16-rounding outliers allowed.
GATE = Tolerance(rtol=1e-2, atol=1e-2, max_mismatch_frac=1e-3)
CALLS = [Shape.uniform(2, 64), Shape.uniform(4, 96), Shape.uniform(2, 48, q_len=2),
         Shape.uniform(1, 80, heads=32, q_len=4)]


@pytest.fixture(scope="module")
def winners_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("submission")
    # The same shapes as test_dispatch.py: the sweep fixture runs once per test process.
    tuned = [Shape.uniform(2, 64), Shape.uniform(4, 256), Shape.uniform(4, 256, kv_format="fp8")]
    with swept_db(root / "t.db", tuned) as store:
        export_winners(store, root / "winners.json")
    return root / "winners.json"


def _load(monkeypatch, path):
    monkeypatch.setenv("MLA_TUNE_WINNERS", str(path))
    import mla_tune.runtime.submission as submission

    return importlib.reload(submission)


@pytest.mark.parametrize("which", ["tuned", "no-file"])
def test_custom_kernel_matches_reference(monkeypatch, winners_file, tmp_path, which):
    sub = _load(monkeypatch, winners_file if which == "tuned" else tmp_path / "none.json")
    assert sub.dispatcher.loaded == (3 if which == "tuned" else 0)
    for shape in CALLS:
        data = generate_input(shape, seed=3, device=sub.dispatcher.device)
        out = sub.custom_kernel(data)
        fmt = sub.dispatcher.choose_format(shape, data[1])
        ref = mla_decode_reference(*data, kv_format=fmt.value)
        result = check(out, ref, GATE)
        assert result.ok, (shape.key, fmt, result.reason)
    assert sub.dispatcher.decide(CALLS[0]).reason == ("exact" if which == "tuned"
                                                      else "heuristic")


def test_custom_kernel_rejects_bad_inputs(monkeypatch, winners_file):
    sub = _load(monkeypatch, winners_file)
    q, kv_data, qo, kvp, config = generate_input(CALLS[0])
    with pytest.raises(ValueError, match="qo_indptr"):
        sub.custom_kernel((q, kv_data, qo[:2], kvp, config))
