"""The run's loss chart (adaptive_ds/training/loss_plot.py), read back as its reader reads it: the data recovered
from the drawn points through the axes' own tick labels, and ticks checked against a search over every candidate
step."""

import json
import math
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaptive_ds.training.loss_plot import nice_ticks, plot_losses, render

SVG = "{http://www.w3.org/2000/svg}"


def _axis(root, kind: str, attribute: str, offset: float = 0.0):
    """The data -> pixel map of an axis, from two of its labelled ticks (a label's position and the value it says)."""
    ticks = [(float(t.get("data-value")), float(t.get(attribute)) - offset) for t in root.iter(f"{SVG}text")
             if t.get("class") == kind]
    assert len(ticks) >= 2
    (v0, p0), (v1, p1) = ticks[0], ticks[-1]
    assert float(next(t.text for t in root.iter(f"{SVG}text") if t.get("class") == kind)) == pytest.approx(v0)
    return lambda pixel: v0 + (pixel - p0) * (v1 - v0) / (p1 - p0)


def _curves(svg: str, name: str) -> list[list[tuple[float, float]]]:
    root = ET.fromstring(svg)
    to_x, to_y = _axis(root, "x-tick", "x"), _axis(root, "y-tick", "y", offset=4)
    return [[(to_x(float(x)), to_y(float(y))) for x, y in (p.split(",") for p in line.get("points").split())]
            for line in root.iter(f"{SVG}polyline") if line.get("class") == name]


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
    floor = next(line for line in root.iter(f"{SVG}line") if line.get("class") == "entropy-floor")
    assert _axis(root, "y-tick", "y", offset=4)(float(floor.get("y1"))) == pytest.approx(1.4876, abs=2e-3)
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
               {"step": 3, "validation_loss": 3.4}]  # a record that only validated has no train loss
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    plot_losses(str(metrics), str(tmp_path / "loss.svg"), None, (4, 3.3))
    svg = (tmp_path / "loss.svg").read_text()
    assert [[x for x, _ in piece] for piece in _curves(svg, "train")] == [[pytest.approx(1, abs=2e-3),
                                                                         pytest.approx(2, abs=2e-3)]]
    (validation,) = _curves(svg, "validation")
    assert validation == [pytest.approx(p, abs=2e-3) for p in [(2, 3.7), (3, 3.4), (4, 3.3)]]
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
    assert nice_ticks(2.0, 2.0)[0] < 2.0 < nice_ticks(2.0, 2.0)[-1]
