"""Route a call through the dispatcher with the user family's tuned winner and check it.

    MLA_TUNE_BACKENDS=examples/user_family/my_mla.toml MLA_TUNE_TRACE=1 \
        python3 examples/user_family/dispatch_example.py --db example.db --shape 4x1024

Prints the routing decision (MLA_TUNE_TRACE=1) and the call's error against the float32
reference; exits 1 when the routed variant is not the user family or the output is wrong.
"""

from __future__ import annotations

import argparse
import sys

import torch

from mla_tune.runtime.dispatcher import Dispatcher
from mla_tune.problem.shapes import parse_shape, generate_input
from mla_tune.problem.reference import mla_decode_reference
from mla_tune.problem.verify import check, tolerance_for


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("--shape", default="4x1024")
    ap.add_argument("--backend", default="my_mla")
    args = ap.parse_args()
    shape = parse_shape(args.shape, kv_format="bf16")
    dispatcher = Dispatcher.from_db(args.db, "cuda", kv_format="bf16")
    decision = dispatcher.decide(shape)
    print(f"decision: {decision.describe()}")
    data = generate_input(shape, seed=3, device="cuda")
    out = dispatcher.run(data)
    res = check(out, mla_decode_reference(*data, kv_format="bf16"), tolerance_for("bf16"))
    print(f"output: ok={res.ok} max_abs_err={res.max_abs_err:.3g} {res.reason}")
    return 0 if res.ok and decision.backend == args.backend else 1


if __name__ == "__main__":
    sys.exit(main())
