"""The device's read ceiling as `mla-tune sweep` measures and stores it
(`mla_tune.bandwidth.measure_read_bandwidth`): every reader's best rate, in a few rounds,
and the fastest, the value reports compare kernels with. A dev script (run on the GPU):

    python3 bench/read_ceiling.py [--rounds 3]
"""

from __future__ import annotations

import argparse

import torch

import benchkit  # noqa: F401 - imports mla_tune from this checkout only
from mla_tune.machine.bandwidth import reader_rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="measurements, each of every reader")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rounds = [reader_rates("cuda") for _ in range(args.rounds)]
    names = list(dict.fromkeys(n for r in rounds for n in r))
    print(f"{'reader':42} " + " ".join(f"{'round ' + str(i + 1):>9}" for i in range(len(rounds))))
    for name in names:
        print(f"{name:42} " + " ".join(f"{r[name]:9.0f}" if name in r else f"{'-':>9}"
                                       for r in rounds))
    best = [max(r.values()) for r in rounds if r]
    print(f"ceiling (fastest reader) per round, GB/s: {', '.join(f'{b:.0f}' for b in best)}")


if __name__ == "__main__":
    main()
