"""Draw the docs' diagrams: each ``docs/diagrams/<name>.txt`` becomes ``docs/_static/<name>.svg``.

Run ``python docs/diagrams/render.py`` after editing a source; ``tests/unit/test_docs_diagrams.py``
fails while an SVG is out of date. It needs nothing but Python (no Graphviz, no browser-side
script), so the docs build the same on a fresh machine. A source is lines of words (quoted like a
shell's; ``#`` starts a comment):

* ``canvas W H`` -- the picture's size in pixels;
* ``box ID X Y W H KIND "title" "line" ...`` -- a rectangle at (X, Y), its title in bold and the
  lines under it; ``KIND`` (``client``, ``meta``, ``bytes``, ``tool``) picks its colours, and a
  ``client`` box is drawn as a stack (there are many of them);
* ``arrow FROM TO KIND X Y ANCHOR "label" ...`` -- a line from box FROM's edge to box TO's,
  ``KIND`` ``meta`` (metadata: thin, blue) or ``bytes`` (tensor bytes: thick, orange), its label
  lines centred on height Y at X (``ANCHOR``: the label's ``start``, ``middle`` or ``end`` there);
  ``arrow2`` draws heads at both ends;
* ``note X Y "text"`` -- a line of text; ``legend X Y`` -- what the two kinds of arrow mean.
"""

from __future__ import annotations

import math
import shlex
import sys
from dataclasses import dataclass
from html import escape
from pathlib import Path

HERE = Path(__file__).resolve().parent
STATIC = HERE.parent / "_static"

FILL = {"client": ("#eef4fb", "#3b6ea8"), "meta": ("#e9f1fb", "#1f4e8c"), "bytes": ("#fdf1e6", "#c0640f"),
        "tool": ("#f3f3f3", "#777777")}
LINE = {"meta": ("#1f4e8c", 1.6), "bytes": ("#d9731a", 4.0)}
FONT = 13
LEADING = 17


class DiagramError(ValueError):
    """A source line the renderer cannot draw (it names the line)."""


@dataclass
class Box:
    x: float
    y: float
    w: float
    h: float
    kind: str
    lines: list[str]

    @property
    def centre(self) -> tuple[float, float]:
        return self.x + self.w / 2, self.y + self.h / 2

    def edge(self, towards: tuple[float, float]) -> tuple[float, float]:
        """Where the line from the centre towards ``towards`` leaves the rectangle."""
        cx, cy = self.centre
        dx, dy = towards[0] - cx, towards[1] - cy
        scale = min(self.w / 2 / abs(dx) if dx else math.inf, self.h / 2 / abs(dy) if dy else math.inf)
        return cx + dx * scale, cy + dy * scale


def _text(x: float, y: float, lines: list[str], *, anchor: str = "middle", bold_first: bool = False) -> list[str]:
    out = []
    for k, line in enumerate(lines):
        weight = ' font-weight="bold"' if bold_first and k == 0 else ""
        out.append(f'<text x="{x:.1f}" y="{y + k * LEADING:.1f}" text-anchor="{anchor}"{weight}>{escape(line)}</text>')
    return out


def _head(x: float, y: float, angle: float, colour: str, size: float) -> str:
    """An arrowhead with its point at (x, y), its base towards ``angle``."""
    points = [(x, y)]
    for turn in (0.45, -0.45):
        points.append((x + size * math.cos(angle + turn), y + size * math.sin(angle + turn)))
    return f'<polygon points="{" ".join(f"{px:.1f},{py:.1f}" for px, py in points)}" fill="{colour}"/>'


def render(source: str) -> str:
    """The SVG text of a diagram source (see the module docstring)."""
    width = height = None
    boxes: dict[str, Box] = {}
    body: list[str] = []
    for number, raw in enumerate(source.splitlines(), 1):
        words = shlex.split(raw, comments=True)
        if not words:
            continue
        what, args = words[0], words[1:]
        try:
            if what == "canvas":
                width, height = (int(a) for a in args)
            elif what == "box":
                name, x, y, w, h, kind, *lines = args
                if kind not in FILL:
                    raise DiagramError(f"box kind {kind!r} is not one of {sorted(FILL)}")
                boxes[name] = box = Box(float(x), float(y), float(w), float(h), kind, lines)
                fill, stroke = FILL[kind]
                if kind == "client":  # many of them: two cards behind
                    for off in (8, 4):
                        body.append(f'<rect x="{box.x + off:.1f}" y="{box.y - off:.1f}" width="{box.w:.1f}" '
                                    f'height="{box.h:.1f}" rx="6" fill="{fill}" stroke="{stroke}"/>')
                body.append(f'<rect x="{box.x:.1f}" y="{box.y:.1f}" width="{box.w:.1f}" height="{box.h:.1f}" '
                            f'rx="6" fill="{fill}" stroke="{stroke}" stroke-width="1.5"/>')
                top = box.centre[1] - (len(lines) - 1) * LEADING / 2 + FONT / 2 - 2
                body += _text(box.centre[0], top, lines, bold_first=True)
            elif what in ("arrow", "arrow2"):
                start, end, kind, lx, ly, anchor, *label = args
                if anchor not in ("start", "middle", "end"):
                    raise DiagramError(f"a label's anchor is start, middle or end, not {anchor!r}")
                if start not in boxes or end not in boxes:
                    raise DiagramError(f"an arrow needs boxes defined above it, not {start!r} -> {end!r}")
                if kind not in LINE:
                    raise DiagramError(f"arrow kind {kind!r} is not one of {sorted(LINE)}")
                colour, stroke = LINE[kind]
                (x1, y1), (x2, y2) = boxes[start].edge(boxes[end].centre), boxes[end].edge(boxes[start].centre)
                angle = math.atan2(y2 - y1, x2 - x1)
                head = 6 + 2.2 * stroke
                # the line stops where the head starts, so a thick line does not poke through it
                back = 0.8 * head
                sx, sy = (x1 + back * math.cos(angle), y1 + back * math.sin(angle)) if what == "arrow2" else (x1, y1)
                ex, ey = x2 - back * math.cos(angle), y2 - back * math.sin(angle)
                body.append(f'<line x1="{sx:.1f}" y1="{sy:.1f}" x2="{ex:.1f}" y2="{ey:.1f}" stroke="{colour}" '
                            f'stroke-width="{stroke}"/>')
                body.append(_head(x2, y2, angle + math.pi, colour, head))
                if what == "arrow2":
                    body.append(_head(x1, y1, angle, colour, head))
                top = float(ly) - (len(label) - 1) * LEADING / 2 + FONT / 2 - 2
                body.append(f'<g fill="{colour}">')
                body += _text(float(lx), top, label, anchor=anchor)
                body.append("</g>")
            elif what == "note":
                x, y, *lines = args
                body.append('<g fill="#555555" font-style="italic">')
                body += _text(float(x), float(y), lines, anchor="start")
                body.append("</g>")
            elif what == "legend":
                x, y = (float(a) for a in args)
                for k, (kind, text) in enumerate((("meta", "metadata (Lua functions, waits)"),
                                                  ("bytes", "tensor bytes"))):
                    colour, stroke = LINE[kind]
                    row = y + k * 22
                    body.append(f'<line x1="{x:.1f}" y1="{row:.1f}" x2="{x + 40:.1f}" y2="{row:.1f}" '
                                f'stroke="{colour}" stroke-width="{stroke}"/>')
                    body += _text(x + 50, row + 4, [text], anchor="start")
            else:
                raise DiagramError(f"unknown statement {what!r}")
        except DiagramError as exc:
            raise DiagramError(f"line {number}: {exc}") from None
        except ValueError as exc:  # a missing or non-numeric argument
            raise DiagramError(f"line {number}: {raw.strip()!r}: {exc}") from None
    if width is None:
        raise DiagramError("the source needs a canvas line")
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="{FONT}" fill="#222222">',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        *body,
        "</svg>",
        "",
    ])


def sources() -> list[Path]:
    """Every diagram source."""
    return sorted(HERE.glob("*.txt"))


def target(source: Path) -> Path:
    """The SVG a source is drawn into."""
    return STATIC / f"{source.stem}.svg"


def main() -> int:
    for source in sources():
        target(source).write_text(render(source.read_text()))
        print(f"{source.relative_to(HERE.parent.parent)} -> {target(source).relative_to(HERE.parent.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
