"""The paged call's input checks on their own: what a page table check returns and
refuses (the wrapper's tests check that it runs them before any launch)."""

from __future__ import annotations

import pytest
import torch

from mla_tune.problem.shapes import KVFormat
from mla_tune.runtime.paged_inputs import check_page_table, check_pool

I32 = torch.int32


def test_a_block_table_padded_with_minus_one_reports_its_used_pages() -> None:
    # Two sequences of a (2, 3) block table, page 16: 20 and 40 tokens use 2 and 3 pages;
    # the entry past sequence 0's pages is -1, never read.
    table = torch.tensor([[5, 9, -1], [2, 11, 7]], dtype=I32)
    got = check_page_table(torch.arange(3, dtype=I32), torch.arange(3, dtype=I32) * 3,
                           table.flatten(), torch.tensor([20, 40], dtype=I32), 1, 16)
    assert got == (11, 40)


@pytest.mark.parametrize("lens,match", [((20, 49), "sequence 1: kv length 49 is beyond"),
                                        ((0, 40), "sequence 0: kv length 0 < q_len 1")])
def test_lengths_outside_their_pages_are_refused(lens: tuple[int, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_page_table(torch.arange(3, dtype=I32), torch.arange(3, dtype=I32) * 3,
                         torch.arange(6, dtype=I32), torch.tensor(lens, dtype=I32), 1, 16)


def test_a_used_negative_page_is_refused() -> None:
    with pytest.raises(ValueError, match="holds page -1"):
        check_page_table(torch.arange(2, dtype=I32), torch.tensor([0, 2], dtype=I32),
                         torch.tensor([3, -1], dtype=I32), torch.tensor([20], dtype=I32), 1, 16)


def test_pools_of_each_format_are_checked_for_their_width_and_page_size() -> None:
    cpu = torch.device("cpu")
    bf16 = torch.zeros((4, 16, 576), dtype=torch.bfloat16)
    assert check_pool(bf16, KVFormat.BF16, 16, cpu)[0] is bf16
    with pytest.raises(ValueError, match=r"\(num_pages, 64, 576\)"):
        check_pool(bf16, KVFormat.BF16, 64, cpu)
    packed, scales = torch.zeros((4, 16, 288), dtype=torch.uint8), torch.zeros((64, 24),
                                                                               dtype=torch.uint8)
    kv, scale, sc = check_pool((packed, scales), KVFormat.MXFP4, 16, cpu)
    assert kv is packed and scale is None and sc is scales
    with pytest.raises(ValueError, match=r"MXFP4 scales must be a \(64, >= 18\)"):
        check_pool((packed, scales[:63]), KVFormat.MXFP4, 16, cpu)
    fp8 = bf16.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"fp8 scale must be a \(1,\) float32"):
        check_pool((fp8, torch.ones(2)), KVFormat.FP8, 16, cpu)
