"""The docs' diagrams are drawn from their sources in ``docs/diagrams/`` by ``docs/diagrams/render.py``
(plain Python, nothing to install): every SVG in ``docs/_static`` matches its source as drawn now,
and the concepts page shows the system's."""

from __future__ import annotations

import importlib.util
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _renderer():
    name = "docs_diagrams_render"
    if name not in sys.modules:  # a dataclass needs its module registered while it is defined
        spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "diagrams" / "render.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_every_svg_is_drawn_from_its_source_as_it_is_now():
    render = _renderer()
    sources = render.sources()
    assert [s.name for s in sources] == ["system.txt"]
    for source in sources:
        drawn = render.render(source.read_text())
        target = render.target(source)
        assert target.is_file(), f"{target} is missing: run python docs/diagrams/render.py"
        assert target.read_text() == drawn, f"{target} is out of date with {source}: run python docs/diagrams/render.py"
        ET.fromstring(drawn)  # well-formed XML


def test_the_system_diagram_names_the_parts_and_the_concepts_page_shows_it():
    svg = (ROOT / "docs" / "_static" / "system.svg").read_text()
    for part in ("rank processes", "Redis / Valkey: the metadata plane", "DRAM storage nodes", "tensor bytes",
                 "no controller process", "XREAD BLOCK", "heartbeat"):
        assert part in svg, part
    page = (ROOT / "docs" / "concepts.md").read_text()
    assert "_static/system.svg" in page and "docs/diagrams/system.txt" in page


def test_a_bad_source_line_is_named():
    render = _renderer()
    with pytest.raises(render.DiagramError, match="line 2: an arrow needs boxes"):
        render.render('canvas 10 10\narrow a b meta 0 0 start "x"')
    with pytest.raises(render.DiagramError, match="line 1: unknown statement 'circle'"):
        render.render("circle 1 2")
    with pytest.raises(render.DiagramError, match="line 2: box kind"):
        render.render('canvas 10 10\nbox a 0 0 1 1 blob "x"')
    with pytest.raises(render.DiagramError, match="canvas"):
        render.render('box a 0 0 1 1 meta "x"')
