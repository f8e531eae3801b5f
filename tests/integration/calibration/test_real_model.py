"""On the real default model: calibration through the MLX target gives sane curves and the real store
keeps them; the auto-mode race runs and its choice decodes exactly like plain greedy decoding."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_dspark.application import bootstrap
from mlx_dspark.application.auto_mode import measure_and_choose
from mlx_dspark.application.calibration import CalibrationPlan, curves_for
from mlx_dspark.application.engine import decode
from mlx_dspark.application.settings import load_settings
from mlx_dspark.domain.events import TokensCommitted
from mlx_dspark.domain.tokens import SamplingParams, StopRule

pytestmark = pytest.mark.slow
PLAN = CalibrationPlan(depth=16, deep_depth=48, warmup=1, repeats=1, overhead_tokens=2)


def test_calibrate_and_choose_on_the_default_model(tmp_path: Path) -> None:
    bootstrap.runtime().prepare()
    settings = load_settings({"model": "default", "cache_dir": str(tmp_path)}, environ={})
    services = bootstrap.build(settings)
    model = services.loader.load_target("default")
    lookup = services.loader.load_drafter("lookup", None, model, bits=None)
    curves = curves_for(services.calibration, model, {"lookup": lookup}, services.clock, plan=PLAN)["lookup"]
    widths = sorted(curves.verify_s)
    assert widths[0] == 1 and widths[-1] == lookup.max_block + 1
    assert all(s > 0 for s in curves.verify_s.values())
    assert curves.slope_s_per_token >= 0 and curves.overhead_s >= 0
    assert (tmp_path / "calibration.json").is_file()

    choice = measure_and_choose(
        services.calibration,
        model,
        {"lookup": lookup, "baseline": None},
        services.clock,
        plan=PLAN,
        race_tokens=4,
        race_prompts=[model.tokenizer.encode("x = [1, 2, 3]\nx = [1, 2,")],
        online=False,
    )
    assert choice.mode in {"lookup", "baseline"} and set(choice.rates) == {"lookup", "baseline"}
    prompt = model.tokenizer.encode("def add(a, b):\n    return a + b\n\ndef add(a, b):\n")
    stop = StopRule(max_tokens=10, eos_ids=frozenset())

    def run(source, policy):  # type: ignore[no-untyped-def]
        out: list[int] = []
        for ev in decode(
            model.target, prompt, SamplingParams(), stop, services.clock, source=source, cap_policy=policy
        ):
            if isinstance(ev, TokensCommitted):
                out.extend(ev.tokens)
        return out

    selection = choice.selector.select(prompt)
    assert run(selection.source, selection.policy) == run(None, None)
