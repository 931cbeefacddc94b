"""The MLA decode problem: shapes, their stable keys, the CLI notation, and task inputs.

Everything downstream (backends, the DB, the dispatcher) names a problem instance by
`Shape.key`, so the key must never change for the same shape.
"""

from __future__ import annotations

import enum
import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
QK_HEAD_DIM = KV_LORA_RANK + QK_ROPE_HEAD_DIM  # 576
V_HEAD_DIM = KV_LORA_RANK  # 512
SM_SCALE = 1.0 / math.sqrt(QK_HEAD_DIM)
MAX_Q_LEN = 4


class KVFormat(str, enum.Enum):
    """How the latent KV cache is stored; decides bytes moved per token."""

    BF16 = "bf16"
    FP8 = "fp8"
    MXFP4 = "mxfp4"

    @property
    def bytes_per_token(self) -> int:
        """Bytes a kernel must read per KV token (problem.md, hardware ceilings)."""
        return {KVFormat.BF16: 1152, KVFormat.FP8: 576, KVFormat.MXFP4: 306}[self]

    @classmethod
    def parse(cls, text: str) -> "KVFormat":
        try:
            return cls(text.strip().lower())
        except ValueError:
            names = ", ".join(f.value for f in cls)
            raise ValueError(f"unknown kv format {text!r}; choose one of: {names}") from None


class ShapeError(ValueError):
    """A shape that cannot describe an MLA decode call."""


@dataclass(frozen=True)
class Shape:
    """One MLA decode problem instance.

    `kv_lens` holds one kv length per sequence; uniform batches store the same length
    `batch` times, so ragged and uniform shapes share one code path.
    """

    batch: int
    kv_lens: tuple[int, ...]
    q_len: int = 1
    heads: int = 16
    kv_format: KVFormat = KVFormat.BF16
    page_size: int = 1
    _key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.kv_format, str) and not isinstance(self.kv_format, KVFormat):
            object.__setattr__(self, "kv_format", KVFormat.parse(self.kv_format))
        object.__setattr__(self, "kv_lens", tuple(int(k) for k in self.kv_lens))
        if self.batch < 1:
            raise ShapeError(f"batch must be >= 1, got {self.batch}")
        if len(self.kv_lens) != self.batch:
            raise ShapeError(f"{len(self.kv_lens)} kv lengths given for batch {self.batch}")
        if min(self.kv_lens) < 1:
            raise ShapeError(f"kv lengths must be >= 1, got {min(self.kv_lens)}")
        if not 1 <= self.q_len <= MAX_Q_LEN:
            raise ShapeError(f"q_len must be in 1..{MAX_Q_LEN}, got {self.q_len}")
        if min(self.kv_lens) < self.q_len:
            raise ShapeError(f"kv length {min(self.kv_lens)} is shorter than q_len {self.q_len}")
        if self.heads < 1:
            raise ShapeError(f"heads must be >= 1, got {self.heads}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ShapeError(f"page size must be a power of two >= 1, got {self.page_size}")
        object.__setattr__(self, "_key", self._make_key())

    @classmethod
    def uniform(cls, batch: int, kv_len: int, **kw: Any) -> "Shape":
        return cls(batch=batch, kv_lens=(kv_len,) * batch, **kw)

    @property
    def is_ragged(self) -> bool:
        return len(set(self.kv_lens)) > 1

    @property
    def kv_len(self) -> int:
        """The longest kv length (the uniform length for uniform batches)."""
        return max(self.kv_lens)

    @property
    def total_kv(self) -> int:
        return sum(self.kv_lens)

    @property
    def total_q(self) -> int:
        return self.batch * self.q_len

    @property
    def kv_bytes(self) -> int:
        """Bytes of KV cache the call must read at least once."""
        return self.total_kv * self.kv_format.bytes_per_token

    def _make_key(self) -> str:
        if self.is_ragged:
            digest = hashlib.sha1(",".join(map(str, self.kv_lens)).encode()).hexdigest()[:10]
            kv = f"kvr{self.total_kv // self.batch}-{digest}"
        else:
            kv = f"kv{self.kv_lens[0]}"
        return (
            f"b{self.batch}-q{self.q_len}-{kv}-h{self.heads}-{self.kv_format.value}"
            f"-p{self.page_size}"
        )

    @property
    def key(self) -> str:
        """Stable text key: the same shape always gives the same key."""
        return self._key

    def label(self) -> str:
        """Short human label in the CLI notation, e.g. `256x8192 bf16 h16 q1`, with the
        page size where it is above 1 (`32x~4179r fp8 h16 q1 p64`): two shapes that differ
        only there are two rows of a report."""
        kv = f"~{self.total_kv // self.batch}r" if self.is_ragged else str(self.kv_lens[0])
        page = f" p{self.page_size}" if self.page_size > 1 else ""
        return f"{self.batch}x{kv} {self.kv_format.value} h{self.heads} q{self.q_len}{page}"

    def with_format(self, kv_format: KVFormat | str) -> "Shape":
        return Shape(self.batch, self.kv_lens, self.q_len, self.heads, KVFormat(kv_format),
                     self.page_size)

    def to_json(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "kv_lens": list(self.kv_lens) if self.is_ragged else self.kv_lens[0],
            "q_len": self.q_len,
            "heads": self.heads,
            "kv_format": self.kv_format.value,
            "page_size": self.page_size,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Shape":
        kv = d["kv_lens"]
        kv_lens = tuple(kv) if isinstance(kv, list) else (int(kv),) * int(d["batch"])
        return cls(int(d["batch"]), kv_lens, int(d.get("q_len", 1)), int(d.get("heads", 16)),
                   KVFormat(d.get("kv_format", "bf16")), int(d.get("page_size", 1)))

    def task_config(self) -> dict[str, Any]:
        """The task's `config` dict for this shape."""
        return {
            "batch_size": self.batch,
            "num_heads": self.heads,
            "num_kv_heads": 1,
            "qk_head_dim": QK_HEAD_DIM,
            "kv_lora_rank": KV_LORA_RANK,
            "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
            "v_head_dim": V_HEAD_DIM,
            "q_seq_len": self.q_len,
            "kv_seq_len": self.kv_len,
            "sm_scale": SM_SCALE,
        }


_SHAPE_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_shape(text: str, *, q_len: int = 1, heads: int = 16,
                kv_format: KVFormat | str = KVFormat.BF16, page_size: int = 1) -> Shape:
    """Parse the CLI notation `BATCHxKV` (e.g. `256x8192`) into a uniform Shape."""
    m = _SHAPE_RE.match(text)
    if not m:
        raise ShapeError(
            f"bad shape {text!r}: expected BATCHxKV with two positive integers, e.g. 256x8192"
        )
    batch, kv = int(m.group(1)), int(m.group(2))
    if batch < 1 or kv < 1:
        raise ShapeError(f"bad shape {text!r}: batch and kv length must both be >= 1")
    return Shape.uniform(batch, kv, q_len=q_len, heads=heads,
                         kv_format=KVFormat(kv_format), page_size=page_size)


_RAGGED_RE = re.compile(r"^\s*uniform\s*:\s*(\d+)\s*-\s*(\d+)\s*$")


@dataclass(frozen=True)
class RaggedLengths:
    """A seeded length distribution for tuning a serving bucket on a representative ragged
    batch (`--ragged uniform:300-8000`): the same text and seed always draw the same
    lengths, on any machine (Python's own generator, not torch's)."""

    low: int
    high: int
    seed: int = 0

    @classmethod
    def parse(cls, text: str, seed: int = 0) -> "RaggedLengths":
        m = _RAGGED_RE.match(text)
        if not m:
            raise ShapeError(f"bad ragged distribution {text!r}: expected uniform:LOW-HIGH "
                             "with kv lengths LOW <= HIGH, e.g. uniform:300-8000")
        low, high = int(m.group(1)), int(m.group(2))
        if not 1 <= low <= high:
            raise ShapeError(f"bad ragged distribution {text!r}: need 1 <= LOW <= HIGH")
        return cls(low, high, seed)

    def text(self) -> str:
        return f"uniform:{self.low}-{self.high}"

    def draw(self, batch: int, cap: int | None = None) -> tuple[int, ...]:
        """`batch` lengths uniform in [low, min(high, cap)]."""
        import random

        high = self.high if cap is None else min(self.high, cap)
        if high < self.low:
            raise ShapeError(f"kv length {cap} is below the distribution's lowest length "
                             f"{self.low} ({self.text()}): give a longer KV or a lower LOW")
        rng = random.Random(f"{self.text()}/{batch}/{self.seed}")
        return tuple(rng.randint(self.low, high) for _ in range(batch))


_BATCH_RE = re.compile(r"^\s*(\d+)\s*$")


def parse_ragged_shape(text: str, ragged: RaggedLengths, *, q_len: int = 1, heads: int = 16,
                       kv_format: KVFormat | str = KVFormat.BF16, page_size: int = 1) -> Shape:
    """`BATCH` or `BATCHxKV` with a length distribution: a ragged Shape whose lengths are
    drawn from `ragged`, at most KV when given (KV caps the lengths)."""
    m = _BATCH_RE.match(text)
    if m:
        batch, cap = int(m.group(1)), None
    else:
        base = parse_shape(text)
        batch, cap = base.batch, base.kv_len
    if batch < 1:
        raise ShapeError(f"bad shape {text!r}: batch must be >= 1")
    return Shape(batch, ragged.draw(batch, cap), q_len, heads, KVFormat(kv_format), page_size)


# torch is imported where inputs are made, not here: `mla-tune report`, `diff` and
# `export` import this module and never need torch (1.2 s of CLI start-up).
TaskInput = tuple["torch.Tensor", dict[str, Any], "torch.Tensor", "torch.Tensor", dict[str, Any]]


def generate_input(shape: Shape, seed: int = 0, device: str | torch.device = "cpu") -> TaskInput:
    """Build exactly the task's `(q, kv_data, qo_indptr, kv_indptr, config)` tuple.

    `kv_data` holds all three formats quantized from the same bf16 cache, as the task does,
    so a kernel of any format can be checked against the same reference.
    """
    import torch

    from mla_tune.problem import quant

    # Drawn on the target device: a GPU-sized cache (1.2 G values for 256x8192) would take
    # seconds to draw on the host. Same seed and device give the same input.
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn((shape.total_q, shape.heads, QK_HEAD_DIM), generator=gen,
                    dtype=torch.float32, device=device).to(torch.bfloat16)
    kv = torch.randn((shape.total_kv, 1, QK_HEAD_DIM), generator=gen,
                     dtype=torch.float32, device=device).to(torch.bfloat16)
    kv_data = {
        "bf16": kv,
        "fp8": quant.quantize_fp8(kv),
        "mxfp4": quant.quantize_mxfp4(kv),
    }
    qo_indptr = torch.arange(0, shape.total_q + 1, shape.q_len, dtype=torch.int32)
    lens = torch.tensor((0,) + shape.kv_lens, dtype=torch.int64)
    kv_indptr = torch.cumsum(lens, 0).to(torch.int32)
    config = shape.task_config()
    return q, kv_data, qo_indptr.to(device), kv_indptr.to(device), config
