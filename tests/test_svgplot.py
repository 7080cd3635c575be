"""`forged bench --plot FILE.svg` needs no matplotlib (the package has none); a PNG
without it is a clear error, not a traceback."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from forged.observe.loadtest import plot

SVG = "{http://www.w3.org/2000/svg}"


def result() -> dict[str, object]:
    runs = []
    for url, slow in (("http://a", 1.0), ("http://b", 2.0)):
        for c in (1, 4, 16):
            runs.append({"url": url, "concurrency": c, "summary": {
                "ttft_p99": 0.05 * c * slow, "itl_p99": 0.01 * slow + 0.001 * c}})
    return {"runs": runs}


def test_an_svg_has_a_line_and_a_legend_entry_per_series(tmp_path: Path) -> None:
    path = tmp_path / "bench.svg"
    plot(result(), path)
    root = ET.fromstring(path.read_text())
    lines = [el for el in root.iter(f"{SVG}polyline")]
    assert len(lines) == 4  # two servers, two percentiles
    assert all(len(el.get("points", "").split()) == 3 for el in lines)
    texts = {el.text for el in root.iter(f"{SVG}text")}
    assert {"ttft_p99 http://a", "itl_p99 http://b", "concurrent requests",
            "latency versus concurrency"} <= texts
    # log axes: decades labelled, the points inside the plot's box
    assert {"1", "10", "0.01", "0.1"} <= texts
    for el in lines:
        for point in el.get("points", "").split():
            x, y = map(float, point.split(","))
            assert 70 <= x <= 680 and 40 <= y <= 340


def test_a_png_without_matplotlib_says_what_to_do(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as in the package
    with pytest.raises(SystemExit, match=r"name an \.svg file instead"):
        plot(result(), tmp_path / "bench.png")
