"""GraphedLaunch: which calls launch eagerly, capture, or replay (the policy, on CPU with a
capture that records; the CUDA graph path itself is tested on the GPU in test_wrapper)."""

from __future__ import annotations

from typing import Any

import torch

from mla_tune.runtime.launch_graphs import GraphedLaunch


class Recorder:
    """A launch function and a capture that replays it by calling it again, counting
    which path every call took."""

    def __init__(self) -> None:
        self.eager: list[tuple] = []
        self.replayed: list[tuple] = []
        self.captured: list[tuple] = []
        self._replaying = False

    def launch(self, *args: Any) -> str:
        (self.replayed if self._replaying else self.eager).append(args)
        return f"out{args}"

    def capture(self, fn: Any) -> tuple[Any, Any]:
        self._replaying = True
        result = fn()  # what a stream capture records: nothing runs
        self.replayed.pop()
        self._replaying = False

        def replay() -> None:
            self._replaying = True
            fn()
            self._replaying = False

        self.captured.append(result)
        return replay, result


def test_second_call_with_an_argument_tuple_captures_and_later_calls_replay() -> None:
    r = Recorder()
    g = GraphedLaunch(r.launch, torch.device("cpu"), capture=r.capture)
    assert g(1, 2) == "out(1, 2)"
    assert r.eager == [(1, 2)] and not r.captured
    assert g(1, 2) == "out(1, 2)"  # second sighting: captured, then replayed
    assert r.captured == ["out(1, 2)"] and r.replayed == [(1, 2)] and g.captures == 1
    for _ in range(3):
        assert g(1, 2) == "out(1, 2)"
    assert r.eager == [(1, 2)] and len(r.replayed) == 4 and g.captures == 1
    assert g(3, 4) == "out(3, 4)"  # new addresses: eager, no capture
    assert r.eager[-1] == (3, 4) and g.captures == 1


def test_a_cycle_longer_than_the_window_never_captures() -> None:
    r = Recorder()
    g = GraphedLaunch(r.launch, torch.device("cpu"), capacity=3, capture=r.capture)
    for _ in range(4):
        for key in range(4):  # period 4 > 3 recent calls
            g(key)
    assert g.captures == 0 and len(r.eager) == 16
    g(3)  # the last call's tuple again: captured
    assert g.captures == 1


def test_a_models_layers_each_replay_their_own_graph_from_the_second_step() -> None:
    """Plan once per step, run once per layer with the layer's pool and query: 61
    argument tuples in turn (DeepSeek-V3's layers) under the default capacity."""
    r = Recorder()
    g = GraphedLaunch(r.launch, torch.device("cpu"), capture=r.capture)
    layers = [(0x1000 * n, 0x10) for n in range(61)]
    for step in range(3):
        assert [g(*a) for a in layers] == [f"out{a}" for a in layers]
        assert g.captures == (0 if step == 0 else 61)
    assert len(r.eager) == 61 and len(r.replayed) == 2 * 61


def test_graphs_are_bounded_oldest_dropped_first() -> None:
    r = Recorder()
    g = GraphedLaunch(r.launch, torch.device("cpu"), capacity=2, capture=r.capture)
    for key in (1, 2, 3):
        g(key)
        g(key)
    assert g.captures == 3 and len(g._graphs) == 2 and (1,) not in g._graphs
    before = len(r.eager)
    g(2)
    g(3)
    assert len(r.eager) == before  # the two kept replay
    g(1)
    assert len(r.eager) == before + 1  # dropped: eager again


def test_a_failing_capture_turns_graphs_off_and_launches_eagerly() -> None:
    r = Recorder()

    def broken(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    g = GraphedLaunch(r.launch, torch.device("cpu"), capture=broken)
    assert [g(7) for _ in range(4)] == ["out(7,)"] * 4
    assert r.eager == [(7,)] * 4 and g.captures == 0 and "capture failed" in g.off
