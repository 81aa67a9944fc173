"""OUTPUT_DIR/loss.svg: train and validation loss against step, with the corpus's entropy floor where it is known.

Written as SVG text, without a plotting library: importing matplotlib and rendering a PNG took about a second at the
end of every run, more than a short run's own training on a small machine, and a run on a cluster node needs no
plotting extra to leave its curve behind. Browsers, editors, notebooks (`IPython.display.SVG`) and GitHub show it.
"""

from __future__ import annotations

import json
import math
from xml.sax.saxutils import escape

from .checkpoint.storage import write_atomic

WIDTH, HEIGHT = 700, 420
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 20, 50  # the plot area's margins, room for the tick labels and axis titles
TRAIN_COLOR, VALIDATION_COLOR, FLOOR_COLOR = "#1f77b4", "#ff7f0e", "#7f7f7f"


def nice_ticks(low: float, high: float, count: int = 6, min_step: float = 0.0) -> list[float]:
    """About `count` evenly spaced values covering [low, high] at a step of 1, 2 or 5 times a power of ten (and at
    least `min_step`), the first at or below `low` and the last at or above `high`. A range too narrow to tell apart
    from its own values (a flat curve) is widened around them."""
    if not (math.isfinite(low) and math.isfinite(high)) or high < low:
        raise ValueError(f"no ticks for the range [{low}, {high}]")
    flat = high - low <= 1e-9 * max(1.0, abs(low), abs(high))
    if flat:
        middle = (low + high) / 2
        half = max(0.5, 0.05 * abs(middle))
        low, high = middle - half, middle + half
    raw = max((high - low) / max(1, count - 1), min_step)
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw * (1 - 1e-9))
    first, last = math.floor(low / step + 1e-9), math.ceil(high / step - 1e-9)
    return [i * step for i in range(first, last + 1)]


def _labels(ticks: list[float]) -> list[str]:
    """The ticks' labels, with as many decimals as their step needs (0.2, 0.25, 1000), so that no two read alike."""
    step = ticks[1] - ticks[0]
    decimals = max(0, -math.floor(math.log10(step) + 1e-9) + 1)
    for places in range(min(decimals, 15), 16):
        texts = [f"{value:.{places}f}" for value in ticks]
        if len(set(texts)) == len(texts):
            break
    return [text.rstrip("0").rstrip(".") if "." in text else text for text in texts]


def _segments(points: list[tuple[float, float]]) -> list[list[tuple[float, float]]]:
    """The curve in pieces between non-finite values (an overflowed step's loss), as a plot leaves a gap there."""
    pieces, piece = [], []
    for x, y in points:
        if math.isfinite(y):
            piece.append((x, y))
        elif piece:
            pieces.append(piece)
            piece = []
    return [*pieces, piece] if piece else pieces


class _Area:
    """The plot area's data -> pixel map, the ticks' range mapped onto the space inside the margins."""

    def __init__(self, x_ticks: list[float], y_ticks: list[float]):
        self.x_ticks, self.y_ticks = x_ticks, y_ticks
        self.right, self.bottom = WIDTH - RIGHT, HEIGHT - BOTTOM

    def px(self, x: float) -> float:
        x0, x1 = self.x_ticks[0], self.x_ticks[-1]
        return round(LEFT + (x - x0) / (x1 - x0) * (self.right - LEFT), 2)

    def py(self, y: float) -> float:
        y0, y1 = self.y_ticks[0], self.y_ticks[-1]
        return round(self.bottom - (y - y0) / (y1 - y0) * (self.bottom - TOP), 2)


def _frame(area: _Area) -> list[str]:
    """Gridlines and labels at the ticks, the box, the axis titles."""
    right, bottom = area.right, area.bottom
    out = []
    for x, label in zip(area.x_ticks, _labels(area.x_ticks), strict=True):
        out.append(f'<line class="grid" x1="{area.px(x)}" y1="{TOP}" x2="{area.px(x)}" y2="{bottom}" '
                   'stroke="#e5e5e5"/>')
        out.append(f'<text class="x-tick" data-value="{x!r}" x="{area.px(x)}" y="{bottom + 16}" '
                   f'text-anchor="middle">{label}</text>')
    for y, label in zip(area.y_ticks, _labels(area.y_ticks), strict=True):
        out.append(f'<line class="grid" x1="{LEFT}" y1="{area.py(y)}" x2="{right}" y2="{area.py(y)}" '
                   'stroke="#e5e5e5"/>')
        out.append(f'<text class="y-tick" data-value="{y!r}" x="{LEFT - 6}" y="{area.py(y) + 4}" '
                   f'text-anchor="end">{label}</text>')
    middle = (TOP + bottom) / 2
    return [*out,
            f'<rect x="{LEFT}" y="{TOP}" width="{right - LEFT}" height="{bottom - TOP}" fill="none" stroke="black"/>',
            f'<text x="{(LEFT + right) / 2}" y="{HEIGHT - 12}" text-anchor="middle">optimizer step</text>',
            f'<text x="16" y="{middle}" text-anchor="middle" '
            f'transform="rotate(-90 16 {middle})">loss (nats/token)</text>']


def _legend(area: _Area, entries: list[tuple[str, str, str | None]]) -> list[str]:
    """Top right, over a light backing where a curve passes beneath it: (color, text, dash pattern) per entry."""
    if not entries:
        return []
    right = area.right
    out = [f'<rect x="{right - 198}" y="{TOP + 4}" width="192" height="{18 * len(entries) + 6}" fill="white" '
           'fill-opacity="0.85" stroke="#cccccc"/>']
    for row, (color, text, dashes) in enumerate(entries):
        y = TOP + 16 + 18 * row
        dash = f' stroke-dasharray="{dashes}"' if dashes else ""
        out.append(f'<line x1="{right - 190}" y1="{y - 4}" x2="{right - 165}" y2="{y - 4}" stroke="{color}" '
                   f'stroke-width="2"{dash}/>')
        out.append(f'<text x="{right - 158}" y="{y}">{escape(text)}</text>')
    return out


def render(train: list[tuple[float, float]], validation: list[tuple[float, float]],
           entropy_floor: float | None = None) -> str:
    """The chart as an SVG document: the train curve, the validation curve with its points, the floor as a dashed
    line, gridlines at the ticks, a legend."""
    steps = [x for x, _ in train + validation]
    losses = [y for _, y in train + validation if math.isfinite(y)]
    if entropy_floor is not None:
        losses.append(entropy_floor)
    area = _Area(nice_ticks(min(steps, default=0), max(steps, default=1), min_step=1),  # steps are whole
                 nice_ticks(min(losses, default=0), max(losses, default=1)))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>', *_frame(area)]
    legend = []
    if entropy_floor is not None:
        y = area.py(entropy_floor)
        out.append(f'<line class="entropy-floor" x1="{LEFT}" y1="{y}" x2="{area.right}" y2="{y}" '
                   f'stroke="{FLOOR_COLOR}" stroke-dasharray="6 4"/>')
        legend.append((FLOOR_COLOR, f"entropy floor {entropy_floor:.3f}", "6 4"))
    for name, points, color in (("train", train, TRAIN_COLOR), ("validation", validation, VALIDATION_COLOR)):
        if not points:
            continue
        for piece in _segments(points):
            coordinates = " ".join(f"{area.px(x)},{area.py(y)}" for x, y in piece)
            out.append(f'<polyline class="{name}" points="{coordinates}" fill="none" stroke="{color}" '
                       'stroke-width="1.5"/>')
        if name == "validation":
            out.extend(f'<circle class="validation" cx="{area.px(x)}" cy="{area.py(y)}" r="3" fill="{color}"/>'
                       for x, y in points if math.isfinite(y))
        legend.append((color, f"{name} loss", None))
    return "\n".join([*out, *_legend(area, legend), "</svg>"]) + "\n"


def plot_losses(metrics_path: str, svg_path: str, entropy_floor: float | None = None,
                final_validation: tuple[int, float] | None = None) -> None:
    """The chart of a run's metrics.jsonl (and its final validation, which that file may not hold) into `svg_path`,
    written whole or not at all."""
    with open(metrics_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]  # a step that only validated has no train loss
    validation = {r["step"]: r["validation_loss"] for r in records if "validation_loss" in r}
    if final_validation:  # the final one stands for its step (a resume at the last step validates it again)
        step, loss = final_validation
        validation[step] = loss
    write_atomic(svg_path, render(train, sorted(validation.items()), entropy_floor))
