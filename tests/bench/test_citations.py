"""Results and design notes are cited by path from code, configs and docs: every cited
`bench/results/...` or `docs/design/...` path must exist, every markdown link between those
pages must reach its file and heading, and every bench script must be in bench/README.md, so
moving or adding one cannot leave a dangling reference or a script nobody can find."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("README.md", "mla_tune", "kernels", "configs", "docs", "tests", "bench",
           "examples")
SUFFIXES = {".py", ".md", ".toml", ".sh", ".txt", ".cu", ".yml", ".yaml"}
CITATION = re.compile(r"(?<![\w/.-])((?:bench/results|docs/design)(?:/[\w.-]+)*/?)")
LINK = re.compile(r"\]\(([^()\s]+?)\)")


def _text_files() -> list[Path]:
    files = []
    for entry in SCANNED:
        path = ROOT / entry
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        files += [f for f in candidates if f.is_file() and f.suffix in SUFFIXES
                  and "__pycache__" not in f.parts]
    return files


def cited_paths(text: str) -> set[str]:
    """The results and design paths `text` names (a trailing full stop is prose)."""
    return {m.rstrip(".") for m in CITATION.findall(text)}


def test_the_pattern_finds_citations_in_prose_and_links() -> None:
    text = ("see bench/results/read_ceiling.md. Also [x](docs/design/triton_kernel.md#tma), "
            "`bench/results/patches/` and a/bench/results/not_this.md")
    assert cited_paths(text) == {"bench/results/read_ceiling.md",
                                 "docs/design/triton_kernel.md", "bench/results/patches/"}


def test_every_cited_results_or_design_path_exists() -> None:
    missing = []
    for f in _text_files():
        for cited in cited_paths(f.read_text(errors="replace")):
            if not (ROOT / cited).exists():
                missing.append(f"{f.relative_to(ROOT)} cites {cited}")
    assert not missing, "\n".join(missing)


def heading_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces
    to hyphens."""
    heads = re.findall(r"^#+ (.+)$", markdown, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_anchors_follow_github_headings() -> None:
    assert heading_anchors("# A page\n## QK^T of a `kv_load=\"tma\"` tile (commit 1a2b)\n") == \
        {"a-page", "qkt-of-a-kv_loadtma-tile-commit-1a2b"}


def test_every_link_between_results_and_design_pages_reaches_its_heading() -> None:
    broken = []
    pages = [f for f in _text_files() if f.suffix == ".md"]
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("#"):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve()
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)} links to missing {target}")
            elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(
                    dest.read_text()):
                broken.append(f"{page.relative_to(ROOT)} links to {target}: no such heading")
    assert not broken, "\n".join(broken)


def test_every_bench_script_is_in_the_bench_readme() -> None:
    readme = (ROOT / "bench" / "README.md").read_text()
    scripts = sorted(p.name for p in (ROOT / "bench").iterdir()
                     if p.suffix in (".py", ".sh") and p.is_file())
    assert scripts
    assert [s for s in scripts if not re.search(rf"[`/]{re.escape(s)}`", readme)] == []
