"""`top`'s tok/s bar has a scale that means something: the 1-2-5 step above the readings and the served model's
measured plain decoding rate and roofline ceiling (marked on the bar), not the peak seen so far."""

from __future__ import annotations

from typing import Any

import pytest

from mlx_dspark.entrypoints.cli.top import BAR, full_scale, render


@pytest.mark.parametrize(
    ("value", "full"), [(0.0, 10.0), (0.3, 0.5), (7.0, 10.0), (10.0, 10.0), (11.0, 20.0), (21.0, 50.0), (51.0, 100.0)]
)
def test_the_full_scale_is_the_next_1_2_5_step(value: float, full: float) -> None:
    assert full_scale(value) == pytest.approx(full)


def lines(status: dict[str, Any], peak: float) -> tuple[str, str]:
    screen = render({"ready": True, "model": "m", "mode": "dspark", **status}, peak).splitlines()
    (tok_s,) = [line for line in screen if line.startswith("tok/s")]
    (scale,) = [line for line in screen if line.startswith("scale")]
    return tok_s, scale


def test_the_bar_keeps_its_scale_while_new_peaks_stay_under_the_step() -> None:
    # The peak-scaled bar was always full at a new peak; here 23 and then 31 tok/s both read against 0-50.
    first, scale = lines({"live_tok_s": 23.0}, 23.0)
    second, same = lines({"live_tok_s": 31.0}, 31.0)
    assert scale == same and scale.startswith("scale   0-50 tok/s")
    assert first.count("█") == round(BAR * 23 / 50) and second.count("█") == round(BAR * 31 / 50)
    assert "a race or a roofline marks plain decoding" in scale


def test_plain_decoding_and_the_ceiling_are_marked_on_the_bar_and_named() -> None:
    tok_s, scale = lines({"last_tok_s": 12.0, "plain_tok_s": 21.3, "ceiling_tok_s": 40.0}, 12.0)
    assert scale == "scale   0-50 tok/s   │ plain decoding 21.3   ┆ roofline ceiling 40.0"
    cells = tok_s.split()[1]
    assert cells.index("│") == int(BAR * 21.3 / 50) and cells.index("┆") == int(BAR * 40 / 50)
    assert cells.count("█") == round(BAR * 12 / 50)
    # A speculative mode above plain and the ceiling widens the scale to the next step, never past the bar.
    tok_s, scale = lines({"live_tok_s": 64.0, "plain_tok_s": 21.3}, 64.0)
    assert scale.startswith("scale   0-100 tok/s") and len(tok_s.split()[1]) == BAR
