"""`SerialRows`: the step engine's rows port (`domain.ports.RowsBackend`) over any one-request TargetModel: one
row at a time, which is the target itself, its prompt pieces whole. The MLX adapter's batched form
(adapters/mlx/rows.py) serves many rows.
"""

from __future__ import annotations

from collections.abc import Mapping

from mlx_dspark.domain.decoder import Prefill, Verify
from mlx_dspark.domain.ports import Row, RowsBackend, TargetModel
from mlx_dspark.domain.verification.outcome import Acceptance

__all__ = ["Row", "RowsBackend", "SerialRows"]


class SerialRows:
    """The rows port over a one-request TargetModel: one row at a time, which is the target itself."""

    def __init__(self, target: TargetModel) -> None:
        self.target = target
        self._open = False

    @property
    def capacity(self) -> int:
        return 1

    @property
    def speculative(self) -> bool:
        return True

    @property
    def stats(self) -> Mapping[str, int]:
        return {}

    def open(self) -> Row:
        if self._open:
            raise RuntimeError("a one-request target serves one row at a time")
        self._open = True
        row: Row = self.target  # type: ignore[assignment]
        return row

    def close(self, row: Row) -> None:
        self._open = False  # the target keeps its rows: the next request may reuse them (live prefix)

    def prefill(self, row: Row, piece: Prefill) -> tuple[bool, int | None]:
        if piece.last:
            return True, self.target.prefill(piece.tokens, piece.sampling, piece.uniform)
        self.target.extend(piece.tokens)
        return True, None

    def verify(self, calls: Mapping[Row, Verify]) -> dict[Row, Acceptance]:
        ((row, call),) = calls.items()
        verdict = self.target.verify(call.anchor, call.block, call.sampling, call.uniforms, ahead=call.ahead)
        return {row: verdict}

    def commit(self, keep: Mapping[Row, int]) -> None:
        ((_, rows),) = keep.items()
        self.target.commit(rows)
