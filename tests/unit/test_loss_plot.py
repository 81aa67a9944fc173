"""The run's loss chart (adaptive_ds/training/loss_plot.py), read back as its reader reads it: the ticks' printed
labels at the edges of the drawn plot box give each axis's scale, the data is recovered from the drawn points through
them, and ticks are checked against a search over every candidate step."""

import json
import math
import sys
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaptive_ds.training.loss_plot import nice_ticks, plot_losses, render

SVG = "{http://www.w3.org/2000/svg}"


def _box(root) -> tuple[float, float, float, float]:
    """The plot area's drawn frame: left, top, right, bottom."""
    (frame,) = [r for r in root.iter(f"{SVG}rect") if r.get("stroke") == "black"]
    left, top = float(frame.get("x")), float(frame.get("y"))
    return left, top, left + float(frame.get("width")), top + float(frame.get("height"))


def _axis(root, kind: str, attribute: str, offset: float, ends: tuple[float, float]):
    """The pixel -> data map of an axis, from its ticks' printed labels: they read as numbers in increasing order,
    each saying the value it marks, and the first and last sit on the frame's edges (`ends`, in the order of the
    values)."""
    ticks = [(float(t.text), float(t.get(attribute)) - offset, float(t.get("data-value")))
             for t in root.iter(f"{SVG}text") if t.get("class") == kind]
    assert len(ticks) >= 2
    assert [printed for printed, _, _ in ticks] == sorted({printed for printed, _, _ in ticks})  # distinct, rising
    assert all(printed == pytest.approx(value, rel=1e-9, abs=1e-12) for printed, _, value in ticks)
    (v0, p0, _), (v1, p1, _) = ticks[0], ticks[-1]
    assert (p0, p1) == pytest.approx(ends)
    return lambda pixel: v0 + (pixel - p0) * (v1 - v0) / (p1 - p0)


def _curves(svg: str, name: str) -> list[list[tuple[float, float]]]:
    """Each drawn piece of a curve, in data units; every point inside the frame."""
    root = ET.fromstring(svg)
    left, top, right, bottom = _box(root)
    to_x = _axis(root, "x-tick", "x", 0, (left, right))
    to_y = _axis(root, "y-tick", "y", 4, (bottom, top))  # values rise upward; a label sits 4 px below its line
    pieces = [[tuple(map(float, p.split(","))) for p in line.get("points").split()]
              for line in root.iter(f"{SVG}polyline") if line.get("class") == name]
    assert all(left <= x <= right and top <= y <= bottom for piece in pieces for x, y in piece)
    return [[(to_x(x), to_y(y)) for x, y in piece] for piece in pieces]



def test_the_drawn_curves_read_back_as_the_data_through_the_axes_labels():
    train = [(1, 4.91), (2, 4.60), (3, 3.85), (4, 3.10), (5, 2.95)]
    validation = [(2, 4.70), (5, 3.02)]
    svg = render(train, validation, entropy_floor=1.4876)
    (drawn,) = _curves(svg, "train")
    # a hundredth of a pixel is the drawing's resolution: ~1e-4 in loss on this chart's ~4-unit, 350-pixel axis
    assert drawn == [pytest.approx(point, abs=2e-3) for point in train]
    (drawn,) = _curves(svg, "validation")
    assert drawn == [pytest.approx(point, abs=2e-3) for point in validation]
    root = ET.fromstring(svg)
    left, top, right, bottom = _box(root)
    floor = next(line for line in root.iter(f"{SVG}line") if line.get("class") == "entropy-floor")
    to_y = _axis(root, "y-tick", "y", 4, (bottom, top))
    assert to_y(float(floor.get("y1"))) == pytest.approx(1.4876, abs=2e-3)
    circles = [(float(c.get("cx")), float(c.get("cy"))) for c in root.iter(f"{SVG}circle")]
    assert [round(to_y(y), 3) for _, y in circles] == [4.7, 3.02]
    assert "entropy floor 1.488" in svg and "validation loss" in svg


def test_a_non_finite_loss_leaves_a_gap_and_keeps_the_axes_on_the_finite_values():
    train = [(1, 5.0), (2, float("inf")), (3, 4.0), (4, float("nan")), (5, 3.0)]
    svg = render(train, [])
    pieces = _curves(svg, "train")
    assert [[x for x, _ in piece] for piece in pieces] == [[pytest.approx(x, abs=2e-3)] for x in (1, 3, 5)]
    labels = [float(t.get("data-value")) for t in ET.fromstring(svg).iter(f"{SVG}text") if t.get("class") == "y-tick"]
    assert min(labels) <= 3.0 and max(labels) >= 5.0 and max(labels) < 10  # no tick reached for the inf


def test_the_file_holds_the_logged_steps_and_the_final_validation(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.5, "validation_loss": 3.7},
               {"step": 3, "validation_loss": 3.4}, {"step": 4, "loss": 3.2, "validation_loss": 3.31}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))  # step 3 only validated: no train loss
    # the final validation of step 4, run again on a resume at the last step, stands in for the logged one
    plot_losses(str(metrics), str(tmp_path / "loss.svg"), None, (4, 3.3))
    svg = (tmp_path / "loss.svg").read_text()
    assert [[x for x, _ in piece] for piece in _curves(svg, "train")] == [
        [pytest.approx(x, abs=2e-3) for x in (1, 2, 4)]]
    (validation,) = _curves(svg, "validation")
    assert validation == [pytest.approx(p, abs=2e-3) for p in [(2, 3.7), (3, 3.4), (4, 3.3)]]
    assert svg.count('<circle class="validation"') == 3
    assert "entropy" not in svg


def test_a_run_with_one_point_still_has_axes():
    (drawn,) = _curves(render([(1, 4.2)], []), "train")
    assert drawn == [pytest.approx((1, 4.2), abs=2e-3)]


def _reference_step(low: float, high: float, count: int) -> float:
    """The smallest of 1, 2, 5 x 10^k (k from -12 to 12) that spaces at most `count` - 1 intervals over the range."""
    candidates = sorted(m * 10.0 ** k for k in range(-12, 13) for m in (1, 2, 5))
    return next(c for c in candidates if (high - low) / c <= (count - 1) * (1 + 1e-9))


@given(st.floats(-1e4, 1e4), st.floats(1e-3, 1e4), st.integers(3, 10))
def test_ticks_cover_the_range_at_a_round_step(low, width, count):
    high = low + width
    ticks = nice_ticks(low, high, count)
    step = ticks[1] - ticks[0]
    assert step == pytest.approx(_reference_step(low, high, count), rel=1e-6)
    assert all(b - a == pytest.approx(step, rel=1e-6) for a, b in zip(ticks, ticks[1:], strict=False))
    assert ticks[0] <= low + 1e-9 * step and ticks[-1] >= high - 1e-9 * step
    assert ticks[0] > low - step * (1 + 1e-9) and ticks[-1] < high + step * (1 + 1e-9)  # no tick beyond the range's
    assert len(ticks) <= count + 2


def test_no_ticks_for_a_range_that_is_not_one():
    with pytest.raises(ValueError, match="no ticks"):
        nice_ticks(1.0, math.inf)


@pytest.mark.parametrize("low, high", [(2.0, 2.0), (0.0, 1e-13), (0.0, 5e-324), (2.302584, math.nextafter(2.302584, 3)),
                                       (2.0 ** 60, 2.0 ** 60), (1.0, 1.0 + 1e-8), (1e6, 1e6 + 3)])
def test_a_flat_or_narrow_range_still_gets_distinct_ticks_around_it(low, high):
    ticks = nice_ticks(low, high)
    assert 2 <= len(ticks) <= 8 and ticks[0] <= low and ticks[-1] >= high
    assert all(a < b for a, b in zip(ticks, ticks[1:], strict=False))
    (drawn,) = _curves(render([(1, low), (2, high)], []), "train")  # and the chart reads back
    resolution = (ticks[-1] - ticks[0]) * 1e-4  # a hundredth of a pixel of the axis's 350
    assert [y for _, y in drawn] == [pytest.approx(low, abs=resolution), pytest.approx(high, abs=resolution)]


def test_steps_tick_at_whole_numbers():
    root = ET.fromstring(render([(1, 3.0), (2, 2.5)], []))
    assert [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "x-tick"] == ["1", "2"]


def test_the_chart_needs_no_plotting_library(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where the logging extra is not installed
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "loss": 4.0}) + "\n")
    plot_losses(str(metrics), str(tmp_path / "loss.svg"))
    assert ET.parse(tmp_path / "loss.svg").getroot().tag == f"{SVG}svg"
