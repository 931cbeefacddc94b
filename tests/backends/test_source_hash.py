"""Kernel-source hashes move with the code only: comment, docstring and blank-line edits
keep a backend's stored results current; any code edit retires them."""

from __future__ import annotations

from pathlib import Path

import pytest

from mla_tune.backends.source_hash import code_text, hash_source_bytes, hash_sources

KERNEL = '''"""Module docstring."""

import math  # a comment

SCALE = 2.0
"""What SCALE is for."""


def kernel(x, y):
    """Add."""
    # note
    z = x + y   # trailing

    return z * SCALE, f"{x} {y}"
'''


def _write(tmp_path: Path, text: str, name: str = "k.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_code_text_drops_comments_docstrings_and_blank_lines_only() -> None:
    assert code_text(KERNEL) == ("import math\nSCALE = 2.0\ndef kernel(x, y):\n"
                                 "    z = x + y\n    return z * SCALE, f\"{x} {y}\"\n")


@pytest.mark.parametrize("edit", [
    lambda s: s.replace("# a comment", "# another comment, longer"),
    lambda s: s.replace('"""Add."""', '"""Add two numbers.\n\n    Longer now."""'),
    lambda s: s.replace("    # note\n", ""),
    lambda s: s.replace("\n\n\ndef", "\n\ndef"),
    lambda s: s.replace('"""What SCALE is for."""', ""),
])
def test_comment_and_docstring_edits_keep_the_hash(tmp_path: Path, edit) -> None:
    before = hash_sources([_write(tmp_path, KERNEL)])
    after_path = _write(tmp_path, edit(KERNEL), "k.py")
    assert hash_sources([after_path]) == before


@pytest.mark.parametrize("edit", [
    lambda s: s.replace("SCALE = 2.0", "SCALE = 3.0"),
    lambda s: s.replace("x + y", "x - y"),
    lambda s: s.replace('f"{x} {y}"', 'f"{x}  {y}"'),  # an f-string is code, not a docstring
    lambda s: s.replace("    return", "    z = z\n    return"),
])
def test_code_edits_change_the_hash(tmp_path: Path, edit) -> None:
    before = hash_sources([_write(tmp_path, KERNEL)])
    assert hash_sources([_write(tmp_path, edit(KERNEL))]) != before


def test_bytes_hash_moves_with_comments_and_other_files_hash_by_bytes(tmp_path: Path) -> None:
    py = _write(tmp_path, KERNEL)
    old = hash_source_bytes([py])
    py.write_text(KERNEL.replace("# note", "# changed note"))
    assert hash_source_bytes([py]) != old
    toml = _write(tmp_path, "a = 1  # c\n", "space.toml")
    before = hash_sources([toml])
    toml.write_text("a = 1  # changed\n")
    assert hash_sources([toml]) != before  # not Python: every byte counts
