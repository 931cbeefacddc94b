"""Kernel-source hashes: which stored measurements belong to which kernel code.

A trial is reused only while its backend's source hash is unchanged, so the hash must move
with the code and nothing else: an edit to a comment or a docstring changes no kernel, and
must not retire a day of tuning. Python sources are hashed as their code text (comments,
docstrings and blank lines removed, trailing spaces trimmed); other files by their bytes.

The code text is cut out of the file with the positions of `tokenize`'s COMMENT and STRING
tokens, which Python 3.11 to 3.13 report alike (a sweep on the GPU machine and a report on a
laptop must agree), rather than from a dump of the syntax tree, whose fields change between
Python versions. `hash_source_bytes` is the scheme before this one, kept so stored results can
be re-keyed (`mla-tune rehash`).
"""

from __future__ import annotations

import hashlib
import io
import tokenize
from collections.abc import Callable, Iterable
from pathlib import Path

_SKIP = (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)


def code_text(source: str) -> str:
    """`source` without comments, docstrings (string literals standing alone as a
    statement; f-strings are kept) and blank lines, each line's trailing spaces trimmed."""
    cuts: list[tuple[tuple[int, int], tuple[int, int]]] = []
    line: list[tokenize.TokenInfo] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            cuts.append((tok.start, tok.end))
        if tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            if line and all(_plain_string(t) for t in line):
                cuts.append((line[0].start, line[-1].end))
            line = []
        elif tok.type not in _SKIP:
            line.append(tok)
    lines = source.split("\n")
    for (r0, c0), (r1, c1) in sorted(cuts, reverse=True):
        head, tail = lines[r0 - 1][:c0], lines[r1 - 1][c1:]
        lines[r0 - 1:r1] = [head + tail]
    return "\n".join(s.rstrip() for s in lines if s.strip()) + "\n"


def _plain_string(tok: tokenize.TokenInfo) -> bool:
    """A string literal that is not an f-string (Python 3.12 splits f-strings into several
    tokens; 3.11 does not), so a standalone one is removed the same way on every version."""
    if tok.type != tokenize.STRING:
        return False
    prefix = tok.string[:tok.string.index(tok.string[-1])].lower()
    return "f" not in prefix


def hash_sources(paths: Iterable[Path]) -> str:
    """Hash of the code in `paths` (see the module docstring), 16 hex digits."""
    return hash_named_sources((Path(p).name, Path(p).read_bytes()) for p in paths)


def hash_named_sources(files: Iterable[tuple[str, bytes]]) -> str:
    """`hash_sources` of files given as (name, bytes): the same code read elsewhere (from
    git history, `mla-tune rehash --from-git`) hashes the same."""
    return _hash(files, lambda name, data: code_text(data.decode()).encode()
                 if name.endswith(".py") else data)


def hash_source_bytes(paths: Iterable[Path]) -> str:
    """The hash of the files' bytes, comments included: the scheme results were stored
    under before `hash_sources` (re-keyed by `mla-tune rehash`)."""
    return _hash(((Path(p).name, Path(p).read_bytes()) for p in paths), lambda name, data: data)


def _hash(files: Iterable[tuple[str, bytes]], content: Callable[[str, bytes], bytes]) -> str:
    """sha256 over each file's name and `content` (of its bytes), in name order: where
    the files lie (a checkout, site-packages) never changes the hash."""
    h = hashlib.sha256()
    for name, data in sorted(files, key=lambda f: f[0]):
        h.update(name.encode())
        h.update(content(name, data))
    return h.hexdigest()[:16]
