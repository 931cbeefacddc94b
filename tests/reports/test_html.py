"""The HTML report: charts inline as SVG, nothing fetched when opened; PNG charts on request."""

import re
import sys
from html.parser import HTMLParser

import pytest
from typer.testing import CliRunner

from mla_tune.cli.main import app
from mla_tune.db import TrialGroup, TrialResult, TuningStore
from mla_tune.machine.fingerprint import DeviceFingerprint, SoftwareFingerprint
from mla_tune.problem.shapes import Shape
from mla_tune.reports.html import figures, render_html, write_pngs
from mla_tune.reports.table import report_rows
from mla_tune.results.selection import update_winner
from tests.fixtures.sweep_db import SHAPES, copy_db, swept_db

runner = CliRunner()
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class _Tags(HTMLParser):
    """Every start tag with its attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _tags(text: str) -> list[tuple[str, dict[str, str | None]]]:
    parser = _Tags()
    parser.feed(text)
    return parser.tags


def _db_arg(store: TuningStore) -> str:
    return store.url.removeprefix("sqlite:///")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = swept_db(tmp_path_factory.mktemp("html") / "t.db")
    store.set_read_bandwidth(store.devices()[0].id, 50.0)
    return store


def _add_gpu_device(store: TuningStore) -> None:
    """A second device with a library baseline and Triton-style knobs, as an H200 sweep
    stores them (made-up times), so a report spans devices, backends and stacks."""
    dev = store.device_id(DeviceFingerprint("nvidia", "NVIDIA H200", "sm_90", 132, 150 * 2**30))
    sw = store.software_id(SoftwareFingerprint((("python", "3.12"), ("triton", "3.6.0"))))
    shape = Shape.uniform(4, 1024)
    for splits in (1, 4, 16):
        for block in (16, 32):
            store.record_trial(TrialGroup(dev, sw, shape.key, "triton", "aa"),
                               TrialResult(shape.to_json(), "bf16",
                                           {"num_splits": splits, "BLOCK_N": block}, "ok",
                                           stats={"median_us": 5.0 + 20 / splits + block / 16,
                                                  "std_us": 0.1, "n": 50}))
    store.record_trial(TrialGroup(dev, sw, shape.key, "flashinfer", "bb"),
                       TrialResult(shape.to_json(), "bf16", {"page_size": 1}, "ok",
                                   stats={"median_us": 16.8, "std_us": 0.2, "n": 50}))
    update_winner(store, dev, sw, shape.key, {"triton": "aa", "flashinfer": "bb"})


def test_html_is_self_contained_with_inline_svg_charts(store):
    rows = report_rows(store)
    text = render_html(store, rows)
    tags = _tags(text)
    names = [t for t, _ in tags]
    assert names.count("svg") == 1 + len(rows) * 2  # roofline + (num_splits, chunk_size)
    for tag, attrs in tags:
        assert tag not in ("script", "link", "img", "iframe", "object", "embed", "video")
        assert not {"src", "xlink:href", "srcset", "action"} & set(attrs), (tag, attrs)
        assert attrs.get("href", "#").startswith("#"), attrs  # links within the page only
    assert not re.search(r"https?:|url\(|@import", text, re.IGNORECASE)
    csp = [a for t, a in tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy"]
    assert csp and "default-src 'none'" in csp[0]["content"]
    roofline = re.search(r"<svg[^>]*aria-label=\"Roofline[^\"]*\".*?</svg>", text, re.S).group(0)
    assert "measured read bandwidth 50 GB/s" in roofline
    points = re.findall(r"<circle[^>]*><title>([^<]*)</title>", roofline)
    winners = [p for p in points if "GB/s" in p]
    assert len(winners) == len(rows)
    for r in rows:
        assert f"{r.eff_gbps:.0f} GB/s" in roofline
        assert f"<td class=\"n\">{r.median_us:.1f}</td>" in text
        assert f"<td class=\"n\">{r.ci95_us:.2f}</td>" in text
        assert f"{r.pct_of_read_bw:.1f}%" in text


def test_report_on_any_db_devices_backends_and_an_empty_one(store, tmp_path):
    multi = copy_db(store, tmp_path / "multi.db")
    _add_gpu_device(multi)
    rows = report_rows(multi)
    figs = figures(rows, {d.hash: d.read_bw_gbps for d in multi.devices()})
    rooflines = [f for f in figs if f.slug.startswith("roofline-")]
    assert len(rooflines) == 2
    gpu = next(f for f in figs if "kv1024" in f.slug)
    assert [c.title.rsplit(" ", 1)[-1] for c in gpu.charts] == ["num_splits", "BLOCK_N"]
    assert {s.name for s in gpu.charts[0].series} == {"triton"}
    text = render_html(multi, rows)
    assert "<td>flashinfer 16.8</td>" in text  # the library baseline ...
    assert '<td class="n">2.32x</td>' in text  # ... over the winner, 5 + 20 / 16 + 16 / 16 us
    empty = TuningStore(f"sqlite:///{tmp_path / 'empty.db'}")
    assert "No winners stored yet" in render_html(empty, [])
    for db in (multi, empty):
        out = tmp_path / f"{db.url.rsplit('/', 1)[-1]}-report"
        r = runner.invoke(app, ["report", "--db", _db_arg(db), "--html", str(out / "r.html")])
        assert r.exit_code == 0, r.output
        assert (out / "r.html").read_text().startswith("<!doctype html>")


def test_png_charts(store, tmp_path):
    pytest.importorskip("matplotlib")
    rows = report_rows(store)
    written = write_pngs(store, rows, tmp_path / "png")
    assert sorted(p.name for p in written) == sorted(
        ["roofline.png"] + [f"knobs-{s.key}.png" for s in SHAPES])
    for p in written:
        assert p.read_bytes().startswith(PNG_MAGIC)
    r = runner.invoke(app, ["report", "--db", _db_arg(store), "--html",
                            str(tmp_path / "docs" / "r.html"), "--png", str(tmp_path / "docs")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "docs" / "roofline.png").read_bytes().startswith(PNG_MAGIC)


def test_png_without_matplotlib_says_how_to_install(store, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    r = runner.invoke(app, ["report", "--db", _db_arg(store), "--png", str(tmp_path / "png")])
    assert r.exit_code == 2
    assert "pip install 'mla-tune[report]'" in r.output
    assert not (tmp_path / "png").exists()
    r = runner.invoke(app, ["report", "--db", _db_arg(store), "--html", str(tmp_path)])
    assert r.exit_code == 2 and "directory" in r.output


def test_contents_at_the_top_link_every_section_and_shape(store):
    rows = report_rows(store)
    text = render_html(store, rows)
    tags = _tags(text)
    ids = {a["id"] for _, a in tags if "id" in a}
    links = [a["href"][1:] for t, a in tags if t == "a"]
    assert text.index("<nav>") < text.index('id="devices"')
    assert {"devices", "geomeans", "roofline", "winners", "knobs"} <= set(links)
    assert len(links) == 5 + len(rows) and set(links) <= ids


def test_chart_ticks_enclose_the_data_and_the_axis_its_ticks():
    """Knob charts once had points at 1,100-1,250 µs under a top tick of 1000."""
    from mla_tune.reports.html import _Scale

    for values, log in [([1100.0, 1250.0], True), ([14.1, 45.6], True), ([14.1, 15.5], True),
                        ([79.1, 4398.5], True), ([1.3, 2415.9], True), ([0.02, 0.05], True),
                        ([3.0, 3.0], True), ([-5.0, 17.0], False), ([0.0, 0.0], False),
                        ([1e-4, 9e6], True)]:
        scale = _Scale(values, log, 0.0, 1.0)
        assert scale.ticks[0] <= min(values) and scale.ticks[-1] >= max(values), values
        assert 2 <= len(scale.ticks) <= 12, (values, scale.ticks)
        assert scale.lo < scale.ticks[0] and scale.hi > scale.ticks[-1]
        assert all(0.0 < scale(t) < 1.0 for t in scale.ticks)


def test_winners_table_scrolls_and_wraps_its_configs_in_a_narrow_window(store):
    rows = report_rows(store)
    text = render_html(store, rows)
    winners = text[text.index('id="winners"'):text.index('id="knobs"')]
    assert winners.count('<div class="scroll"><table>') == 1
    assert ".scroll{max-width:100%;overflow-x:auto}" in text
    assert re.search(r"td\.cfg\{[^}]*max-width:30em;overflow-wrap:anywhere", text)
    assert winners.count('<td class="cfg"><code>') == len(rows)
