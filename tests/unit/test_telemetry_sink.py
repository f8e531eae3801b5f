"""The structlog sink logs a draft-source switch as one info line naming both sources (rounds stay at
debug; the canonical request line, with the source that ran, is the face's)."""

from __future__ import annotations

from typing import Any

from mlx_dspark.adapters.telemetry.structlog_sink import StructlogTelemetrySink
from mlx_dspark.domain.events import RoundFinished, SourceSwitched


class Lines:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append(("info", event, fields))

    def debug(self, event: str, **fields: Any) -> None:
        self.lines.append(("debug", event, fields))


def test_a_switch_is_one_info_line_naming_both_sources() -> None:
    log = Lines()
    sink = StructlogTelemetrySink(log)
    sink.emit("r1", SourceSwitched(old="dspark", new="baseline", reason="in request: slower than plain"))
    sink.emit("r1", RoundFinished(index=0, source="none", cap=0, drafted=0, accepted=0, committed=1,
                                  draft_s=0.0, verify_s=0.01, depth=5))  # fmt: skip
    infos = [(event, fields) for level, event, fields in log.lines if level == "info"]
    assert infos == [
        (
            "draft_source.switched",
            {"request_id": "r1", "old": "dspark", "new": "baseline", "reason": "in request: slower than plain"},
        )
    ]
    assert [event for level, event, _ in log.lines if level == "debug"] == ["round"]
