"""The round-anatomy script runs on tiny shapes and reports every width's round (its build, dispatch, first and
repeated pass, overlapped) against a plain step, for mlx-lm's caches, key-bucketed ones, compiled verifies and
row-wise projections (which compute what the projection does)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx import nn

ROOT = Path(__file__).resolve().parents[3]


def test_round_anatomy_reports_each_width_against_the_plain_step(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("round_anatomy", ROOT / "scripts" / "round_anatomy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "ra.json"
    kinds = ["plain", "bucketed", "compiled", "rowwise", "fused", "fused-rowwise"]
    args = ["--shapes", "0.6b", "--tiny", "--rounds", "3", "--widths", "1,3", "--caches", ",".join(kinds)]
    assert module.main([*args, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert sorted(doc["results"]) == sorted(f"0.6b/{k}" for k in kinds)
    for result in doc["results"].values():
        assert result["plain_ms"] > 0 and [r["width"] for r in result["widths"]] == [1, 3]
        for r in result["widths"]:
            assert 0 < r["host_ms"] <= r["synced_ms"] and r["overlapped_ms"] > 0
            assert 0 < r["dispatch_ms"] <= r["synced_ms"] and r["repeat_ms"] > 0  # each round dominates its parts
            assert r["ceiling_x"] > 0 and r["synced_x"] > 0
    x = mx.random.normal((1, 8, 64), key=mx.random.key(0))
    linear = nn.Linear(64, 96, bias=True)
    assert mx.allclose(module._rowwise(linear, x), linear(x), atol=1e-5).item()
    assert module._rowwise(linear, x[:, :1]).shape == (1, 1, 96)  # one row: the projection's own path
