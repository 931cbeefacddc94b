"""Probe batches: small ragged batches a variant must also get right before it is timed.

A sweep verifies a variant on the shape it tunes, and a uniform shape such as 256x8192 has
every length a multiple of every tile size, so a kernel that drops a sequence's partial last
tile, mishandles a sequence shorter than one tile or masks the wrong causal rows (q_len > 1)
would pass there. The runtime may still run that variant on other lengths (a bucket or the
nearest tuned shape serves calls with no exact winner), so each variant is also checked on
a ragged batch derived from the shape: the same q_len, heads, format and page size, and
lengths no longer than the shape's longest: one just short of it (a partial last tile and
split), one of two tiles and a key, one of 13-28 keys, repeated; and the same at q_len 4,
whose causal rows a q_len-1 shape never exercises.

The batch keeps the shape's batch size class (16 sequences when the shape's batch is a
multiple of 16, else 3) and a key total that is a multiple of 16, so integer arguments that
JIT compilers specialize on (divisible by 16 or not) fall in the same class as the shape's,
and a probe seldom compiles a kernel of its own.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import cycle, islice

from mla_tune.problem.shapes import Shape

SHORT = 13
"""The shortest probe sequence's least length: fewer keys than a 16-key tile."""


def probe_lengths(longest: int, q_len: int, batch: int) -> tuple[int, ...]:
    """kv lengths (each >= q_len, none above `longest`) whose tails cut every tile size the
    families use (16 to 128 keys): longest - 37, 129 and 13-28 keys, repeated for 16
    sequences when `batch` is a multiple of 16 (else 3), the last one picked in that range
    so the total is a multiple of 16. (Not fewer than 13: the Triton family's bf16 kernel,
    run by the interpreter, mismatches 0.10-0.18 % of a probe's elements with a 4- or
    5-key sequence in it, over the bf16 gate's 0.1 %, from bf16 rounding where outputs
    are largest; with 13-15 keys 0.016-0.039 %.)"""
    base = tuple(max(q_len, min(longest, n)) for n in (longest - 37, 129, SHORT))
    lens = list(islice(cycle(base), 16 if batch % 16 == 0 else 3))
    rest = sum(lens[:-1])
    lens[-1] = max(q_len, min(longest, SHORT + (-(rest + SHORT)) % 16))
    return tuple(lens)


PROBE_Q_LEN = 4
"""The q_len of the causal probe: routing may carry a winner to another q_len family
(mla_tune/runtime/routing.py), so a q_len-1 variant must mask q_len > 1 rows right too."""


def probe_shapes(shape: Shape) -> tuple[Shape, ...]:
    """The probe batches of `shape`: ragged at its own q_len, and ragged at PROBE_Q_LEN
    when that differs and the shape's longest sequence holds it (none that equals `shape`)."""
    longest = max(shape.kv_lens)
    probes = []
    for q_len in dict.fromkeys((shape.q_len, PROBE_Q_LEN)):
        if q_len <= longest:
            lens = probe_lengths(longest, q_len, shape.batch)
            probes.append(replace(shape, batch=len(lens), kv_lens=lens, q_len=q_len))
    return tuple(p for p in probes if p != shape)
