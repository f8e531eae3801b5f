"""What a calibration is keyed by and what it records: values only, the store adapter serializes them."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from mlx_dspark.domain.costmodel.curves import CostCurves

# Bump when the meaning of a stored field changes; entries of another schema are never read back.
# 2: a draft model's draft_s is the cost of full blocks (schema 1 timed its confidence stop: about one draft a cap).
# 3: each point's repeats taken in turns with the other points' (schema 2 timed them back to back, so a passing
#    load could move one width alone).
CALIBRATION_SCHEMA = 3


@attrs.frozen(kw_only=True)
class CalibrationKey:
    """The full identity a measurement is valid for.

    Device and MLX version are filled in by the store (it is the adapter that can see them), so use
    cases only name the models.

    Attributes:
        target: target identity (repo id or path + revision or content hash), never a basename.
        drafter: drafter identity ("none", "lookup:block=8", "dspark:<repo>@<rev>", "race2:<kinds>").
        drafter_bits: drafter quantization (None = as loaded).
    """

    target: str
    drafter: str
    drafter_bits: int | None = None


@attrs.frozen(kw_only=True)
class Calibration:
    """One stored measurement.

    Attributes:
        curves: the cost curves of (target, drafter), or None for a race-only record.
        race: measured decode tokens per second per mode name, from the auto-mode race.
        chosen: the mode the race picked, or None.
        created: wall-clock seconds since the epoch when it was measured.
    """

    curves: CostCurves | None = None
    race: Mapping[str, float] = attrs.field(factory=dict)
    chosen: str | None = None
    created: float = 0.0
