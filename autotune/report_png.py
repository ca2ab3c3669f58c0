"""front.png: the static memory-vs-throughput plot, drawn with Pillow.

The figure matplotlib drew before (8 x 5 in at 110 dpi; matplotlib's default sizes: markers of
area ``s`` pt^2, 10 pt labels, 12 pt title, 8 pt legend, 5% data margins, ticks of its
MaxNLocator steps 1, 2, 2.5, 5, 10), drawn directly: importing matplotlib alone took longer than a
whole simulate run's search. Shapes are drawn at ``SUPERSAMPLE`` times the size and scaled down,
which smooths their edges; text is in Pillow's built-in font.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional, Sequence

WIDTH_IN, HEIGHT_IN, DPI = 8, 5, 110
SUPERSAMPLE = 2
PX = DPI / 72 * SUPERSAMPLE
"""Pixels (of the supersampled canvas) per point."""
MARGIN = 0.05
"""matplotlib's default axes margins (axes.xmargin / axes.ymargin)."""
STEPS = (1, 2, 2.5, 5, 10)
"""matplotlib.ticker.AutoLocator's steps."""
LIGHT_GRID = (0xb0, 0xb0, 0xb0)


def _font(size_pt: float) -> Any:
    """Pillow's built-in font (Aileron, FreeType) at ``size_pt`` points: the same text on every install."""
    from PIL import ImageFont

    return ImageFont.load_default(max(1, round(size_pt * PX)))


def nice_ticks(lo: float, hi: float, nbins: int) -> list[float]:
    """Tick values covering [lo, hi]: the smallest step of STEPS x 10^k giving at most ``nbins``
    intervals (matplotlib.ticker.MaxNLocator's rule, simplified)."""
    if not hi > lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(1, nbins)
    scale = 10 ** math.floor(math.log10(raw))
    step = next((s * scale for s in STEPS if s * scale >= raw * (1 - 1e-9)), 10 * scale)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + k * step, 12) for k in range(int((hi - first) / step + 1e-9) + 1)]


def tick_label(v: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step < 1 else 0
    text = f"{v:.{decimals}f}"
    return "0" if float(text) == 0 else text.replace("-", "\u2212")


def _rgba(color: str, alpha: float = 1.0) -> tuple[int, int, int, int]:
    named = {"black": "#000000", "gold": "#ffd700", "white": "#ffffff"}
    h = named.get(color, color).lstrip("#")
    return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16), round(255 * alpha)


def _star(cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    """matplotlib's '*' marker: a five-pointed star, inner radius 0.381966 of the outer."""
    pts = []
    for k in range(10):
        rad = r if k % 2 == 0 else r * 0.381966
        a = math.pi / 2 + k * math.pi / 5
        pts.append((cx + rad * math.cos(a), cy - rad * math.sin(a)))
    return pts


class _Canvas:
    def __init__(self) -> None:
        from PIL import Image, ImageDraw

        self.w, self.h = WIDTH_IN * DPI * SUPERSAMPLE, HEIGHT_IN * DPI * SUPERSAMPLE
        self.img = Image.new("RGB", (self.w, self.h), (255, 255, 255))
        self.draw = ImageDraw.Draw(self.img)
        self.fonts = {size: _font(size) for size in (8, 10, 12)}
        self.tiles: dict[tuple, Any] = {}

    def text_size(self, text: str, size: int) -> tuple[int, int]:
        box = self.draw.textbbox((0, 0), text, font=self.fonts[size])
        return box[2] - box[0], box[3] - box[1]

    def text(self, xy: tuple[float, float], text: str, size: int, anchor: str) -> None:
        self.draw.text(xy, text, fill=(0, 0, 0, 255), font=self.fonts[size], anchor=anchor)

    def vtext(self, xy: tuple[float, float], text: str, size: int) -> None:
        """Text rotated 90 degrees (read bottom to top), centred at ``xy``."""
        from PIL import Image, ImageDraw

        w, h = self.text_size(text, size)
        pad = 4 * SUPERSAMPLE
        tile = Image.new("RGBA", (w + 2 * pad, h + 2 * pad), (255, 255, 255, 0))
        ImageDraw.Draw(tile).text((tile.width / 2, tile.height / 2), text, fill=(0, 0, 0, 255),
                                  font=self.fonts[size], anchor="mm")
        tile = tile.rotate(90, expand=True)
        self.paste(tile, xy[0] - tile.width / 2, xy[1] - tile.height / 2)

    def marker(self, kind: str, cx: float, cy: float, size_pt2: float, face: Optional[str], edge: Optional[str],
               alpha: float = 1.0, edge_pt: float = 1.0) -> None:
        """One scatter marker of area ``size_pt2`` (pt^2, matplotlib's ``s``; its edge is centred on the
        outline), composited with ``alpha``."""
        key = (kind, size_pt2, face, edge, alpha, edge_pt)
        tile = self.tiles.get(key)
        if tile is None:
            tile = self.tiles[key] = _marker_tile(kind, size_pt2, face, edge, alpha, edge_pt)
        self.paste(tile, cx - tile.width / 2, cy - tile.height / 2)

    def paste(self, tile: Any, x: float, y: float) -> None:
        """Blend an RGBA tile onto the canvas by its alpha, top-left corner at (x, y)."""
        self.img.paste(tile, (round(x), round(y)), mask=tile)

    def dashed(self, p0: tuple[float, float], p1: tuple[float, float], color: str, width_pt: float,
               dash_pt: tuple[float, float]) -> None:
        (x0, y0), (x1, y1) = p0, p1
        length = math.hypot(x1 - x0, y1 - y0)
        on, off = dash_pt[0] * width_pt * PX, dash_pt[1] * width_pt * PX
        t = 0.0
        while t < length:
            a, b = t / length, min(t + on, length) / length
            self.draw.line(((x0 + a * (x1 - x0), y0 + a * (y1 - y0)), (x0 + b * (x1 - x0), y0 + b * (y1 - y0))),
                           fill=_rgba(color), width=max(1, round(width_pt * PX)))
            t += on + off


def _marker_tile(kind: str, size_pt2: float, face: Optional[str], edge: Optional[str], alpha: float,
                 edge_pt: float) -> Any:
    from PIL import Image, ImageDraw

    lw = max(1, round(edge_pt * PX))
    r = math.sqrt(size_pt2) / 2 * PX + (lw / 2 if edge else 0)
    half = math.ceil(r + lw) + 2
    tile = Image.new("RGBA", (2 * half, 2 * half), (0, 0, 0, 0))
    d = ImageDraw.Draw(tile)  # drawing on a clear tile sets (not blends) pixels: one alpha for the marker
    c = half
    fill = _rgba(face, alpha) if face else None
    line = _rgba(edge, alpha) if edge else None
    if kind == "o":
        d.ellipse((c - r, c - r, c + r, c + r), fill=fill, outline=line, width=lw if line else 0)
    elif kind == "x":
        for a, b in (((c - r, c - r), (c + r, c + r)), ((c - r, c + r), (c + r, c - r))):
            d.line((a, b), fill=line or fill, width=lw)
    elif kind == "*":
        pts = _star(c, c, r * 1.25)
        d.polygon(pts, fill=fill)
        if line:
            d.line(pts + [pts[0]], fill=line, width=lw, joint="curve")
    return tile


# The series, in drawing (and legend) order: category, marker, face, edge, area pt^2, alpha.
SERIES = (("pruned", "o", None, "#7f7f7f", 18, 1.0),
          ("failed", "x", None, "black", 30, 1.0),
          ("dominated", "o", "#1f77b4", "#1f77b4", 18, 0.6),
          ("front", "o", "#d62728", "#d62728", 40, 1.0))


def write_front_png(pts: dict[str, list[dict[str, Any]]], labels: dict[str, str], best: Optional[tuple[float, float]],
                    capacity: Optional[float], title: str, xlabel: str, ylabel: str, path: str) -> str:
    """Draw the plot of ``pts`` (report.plot_points: category -> points with memory_gib and
    tokens_per_s) and save it as PNG at ``path``. ``labels``: category -> legend text; ``best``: the
    recommended point (memory GiB, tokens/s), a gold star; ``capacity``: the GPU memory line."""
    cv = _Canvas()
    xs = [p["memory_gib"] for ps in pts.values() for p in ps] + ([best[0]] if best else [])
    ys = [p["tokens_per_s"] for ps in pts.values() for p in ps] + ([best[1]] if best else [])
    xs += [capacity] if capacity else []
    x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
    y0, y1 = (min(ys), max(ys)) if ys else (0.0, 1.0)
    x0, x1 = _pad(x0, x1)
    y0, y1 = _pad(y0, y1)
    # the axes box: room for the title above, the tick labels and axis labels left and below
    pad = 0.06 * DPI * SUPERSAMPLE
    label_h = cv.text_size("Ag", 10)[1]
    yt = nice_ticks(y0, y1, 8)
    ystep = yt[1] - yt[0] if len(yt) > 1 else 1.0
    tick_w = max(cv.text_size(tick_label(v, ystep), 10)[0] for v in yt) if yt else 0
    tick_len = 3.5 * PX
    left = pad + label_h * 1.6 + 3.5 * PX + tick_w + tick_len
    bottom = cv.h - (pad + label_h * 1.3 + 3.5 * PX + label_h * 1.2 + tick_len)
    top = pad + cv.text_size("Ag", 12)[1] * 1.6
    right = cv.w - pad - 0.1 * DPI * SUPERSAMPLE

    def X(v: float) -> float:
        return left + (v - x0) / (x1 - x0) * (right - left)

    def Y(v: float) -> float:
        return bottom - (v - y0) / (y1 - y0) * (bottom - top)

    xt = nice_ticks(x0, x1, max(1, min(9, int((right - left) / (10 * PX * 3)))))
    xstep = xt[1] - xt[0] if len(xt) > 1 else 1.0
    grid = tuple(round(255 - 0.3 * (255 - c)) for c in LIGHT_GRID) + (255,)
    for v in xt:
        cv.draw.line(((X(v), top), (X(v), bottom)), fill=grid, width=round(0.8 * PX))
    for v in yt:
        cv.draw.line(((left, Y(v)), (right, Y(v))), fill=grid, width=round(0.8 * PX))
    legend: list[tuple[str, Any]] = []
    for cat, kind, face, edge, area, alpha in SERIES:
        ps = pts.get(cat) or []
        if not ps:
            continue
        if cat == "front":
            line = [(X(p["memory_gib"]), Y(p["tokens_per_s"])) for p in ps]
            steps = [line[0]] + [q for a, b in zip(line, line[1:]) for q in ((b[0], a[1]), b)]
            cv.draw.line(steps, fill=_rgba("#d62728"), width=round(1.0 * PX))
        for p in ps:
            cv.marker(kind, X(p["memory_gib"]), Y(p["tokens_per_s"]), area, face, edge, alpha)
        legend.append((labels[cat], (kind, face, edge, min(area, 40), alpha)))
    if best:
        cv.marker("*", X(best[0]), Y(best[1]), 260, "gold", "black")
        legend.append(("recommended", ("*", "gold", "black", 260, 1.0)))
    if capacity:
        cv.dashed((X(capacity), top), (X(capacity), bottom), "black", 1.0, (3.7, 1.6))
        legend.append(("GPU memory", None))
    # clear what was drawn outside the axes box (matplotlib clips artists to it)
    white = (255, 255, 255, 255)
    for box in ((0, 0, cv.w, top), (0, bottom, cv.w, cv.h), (0, 0, left, cv.h), (right, 0, cv.w, cv.h)):
        cv.draw.rectangle(box, fill=white)
    spine = round(0.8 * PX)
    cv.draw.rectangle((left, top, right, bottom), outline=(0, 0, 0, 255), width=spine)
    for v in xt:
        cv.draw.line(((X(v), bottom), (X(v), bottom + tick_len)), fill=(0, 0, 0, 255), width=spine)
        cv.text((X(v), bottom + tick_len + 3.5 * PX), tick_label(v, xstep), 10, "mt")
    for v in yt:
        cv.draw.line(((left - tick_len, Y(v)), (left, Y(v))), fill=(0, 0, 0, 255), width=spine)
        cv.text((left - tick_len - 3.5 * PX, Y(v)), tick_label(v, ystep), 10, "rm")
    cv.text(((left + right) / 2, top - 6 * PX), title, 12, "ms")
    cv.text(((left + right) / 2, cv.h - pad), xlabel, 10, "md")
    cv.vtext((pad + label_h * 0.8, (top + bottom) / 2), ylabel, 10)
    if legend:
        _legend(cv, legend, (left, top, right, bottom),
                [(X(p["memory_gib"]), Y(p["tokens_per_s"])) for ps in pts.values() for p in ps])
    out = cv.img.reduce(SUPERSAMPLE)  # box filter: each pixel the mean of its 2 x 2
    tmp = f"{path}.tmp"
    out.save(tmp, format="PNG", compress_level=3)  # zlib level 3: a third faster than 6, 1% larger here
    os.replace(tmp, path)
    return path


def _pad(lo: float, hi: float) -> tuple[float, float]:
    if hi <= lo:
        return lo - 1.0, hi + 1.0
    m = MARGIN * (hi - lo)
    return lo - m, hi + m


def _legend(cv: _Canvas, entries: list[tuple[str, Any]], axes: tuple[float, float, float, float],
            points: Sequence[tuple[float, float]]) -> None:
    """matplotlib's legend at loc="best": of its candidate places (upper right, upper left, lower left,
    lower right, right, center left, center right, lower center, upper center, center), the first
    that covers the fewest data points."""
    em = 8 * PX
    row = cv.text_size("Ag", 8)[1] * 1.7
    handle = 2.0 * em
    width = max(cv.text_size(text, 8)[0] for text, _ in entries) + handle + 2.2 * em
    height = row * len(entries) + 0.8 * em
    left, top, right, bottom = axes
    gap = 0.5 * em
    xs = {"left": left + gap, "right": right - gap - width, "center": (left + right - width) / 2}
    ys = {"upper": top + gap, "lower": bottom - gap - height, "center": (top + bottom - height) / 2}
    places = [("right", "upper"), ("left", "upper"), ("left", "lower"), ("right", "lower"), ("right", "center"),
              ("left", "center"), ("right", "center"), ("center", "lower"), ("center", "upper"),
              ("center", "center")]

    def covered(place: tuple[str, str]) -> int:
        bx, by = xs[place[0]], ys[place[1]]
        return sum(bx <= x <= bx + width and by <= y <= by + height for x, y in points)

    bx, by = (xs[place[0]], ys[place[1]]) if (place := min(places, key=covered)) else (0, 0)
    from PIL import Image, ImageDraw

    frame = Image.new("RGBA", (math.ceil(width) + 1, math.ceil(height) + 1), (0, 0, 0, 0))
    ImageDraw.Draw(frame).rounded_rectangle((0, 0, width, height), radius=0.4 * em, fill=(255, 255, 255, 204),
                                            outline=(0xcc, 0xcc, 0xcc, 204), width=round(0.8 * PX))
    cv.paste(frame, bx, by)
    for k, (text, style) in enumerate(entries):
        cy = by + 0.4 * em + row * (k + 0.5)
        hx = bx + 0.5 * em
        if style is None:
            cv.dashed((hx, cy), (hx + handle, cy), "black", 1.0, (3.7, 1.6))
        else:
            kind, face, edge, area, alpha = style
            cv.marker(kind, hx + handle / 2, cy, area, face, edge, alpha)
        cv.text((hx + handle + 0.8 * em, cy), text, 8, "lm")
