"""Page tables over the contiguous cache (CPU): every page size must hand each sequence
exactly its own rows, in order, for uniform and ragged batches alike."""

import pytest
import torch

from mla_tune.backends.vendor import contiguous_page_table, page_layout_problem, warmup_input
from mla_tune.problem.shapes import Shape


def _gather(kv: torch.Tensor, table) -> list[torch.Tensor]:
    """Read each sequence back through the page table, as a paged kernel does."""
    pages = kv.view(table.num_pages, table.page_size, *kv.shape[1:])
    out = []
    for b in range(len(table.kv_lens)):
        ids = table.kv_indices[table.kv_indptr[b]:table.kv_indptr[b + 1]].long()
        rows = pages[ids].reshape(-1, *kv.shape[1:])
        n = (len(ids) - 1) * table.page_size + int(table.last_page_len[b])
        out.append(rows[:n])
    return out


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("kv_lens", [
    (1024, 1024, 1024),                # uniform
    (64, 1024, 192, 128, 8192 - 64),   # ragged, every length a multiple of 64
    (3072, 64),
])
def test_gathered_tokens_equal_contiguous_tokens(page_size, kv_lens):
    kv = torch.randn(sum(kv_lens), 1, 576)
    table = contiguous_page_table(kv_lens, page_size)
    assert table.num_pages == sum(kv_lens) // page_size
    assert table.kv_indptr.dtype == table.kv_indices.dtype == table.last_page_len.dtype \
        == torch.int32
    assert table.last_page_len.tolist() == [page_size] * len(kv_lens)
    starts = [0]
    for n in kv_lens:
        starts.append(starts[-1] + n)
    for b, rows in enumerate(_gather(kv, table)):
        assert torch.equal(rows, kv[starts[b]:starts[b + 1]])


def test_page_size_one_handles_any_ragged_lengths():
    lens = (37, 1, 500, 3)
    kv = torch.randn(sum(lens), 1, 8)
    table = contiguous_page_table(lens, 1)
    assert table.last_page_len.tolist() == [1, 1, 1, 1]
    assert [len(r) for r in _gather(kv, table)] == list(lens)
    assert torch.equal(torch.cat(_gather(kv, table)), kv)


@pytest.mark.parametrize("page_size", [16, 64])
def test_misaligned_lengths_are_refused_with_a_reason(page_size):
    lens = (100, 64)
    reason = page_layout_problem(lens, page_size)
    assert reason and "100" in reason and "multiple" in reason
    with pytest.raises(ValueError, match="multiple"):
        contiguous_page_table(lens, page_size)
    assert page_layout_problem((64 * 3, 64), page_size) is None


def test_warmup_input_holds_only_the_read_format():
    shape = Shape(2, (64, 128), q_len=2, heads=16)
    q, kv_data, qo, kv_indptr, config = warmup_input(shape, torch.float8_e4m3fn, "cpu")
    assert q.shape == (4, 16, 576) and q.dtype == torch.bfloat16
    kv, scale = kv_data["fp8"]
    assert set(kv_data) == {"fp8"} and kv.shape == (192, 1, 576) and float(scale) == 1.0
    assert qo.tolist() == [0, 2, 4] and kv_indptr.tolist() == [0, 64, 192]
    assert config["q_seq_len"] == 2
