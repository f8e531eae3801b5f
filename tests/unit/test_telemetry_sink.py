"""The structlog sink names the draft source: a switch is one info line, and the canonical
`request.finished` line says which source ran."""

from __future__ import annotations

from typing import Any

from mlx_dspark.adapters.telemetry.structlog_sink import StructlogTelemetrySink
from mlx_dspark.domain.events import Finished, RoundFinished, SourceSwitched, Usage
from mlx_dspark.domain.tokens import FinishReason


class Lines:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append(("info", event, fields))

    def debug(self, event: str, **fields: Any) -> None:
        self.lines.append(("debug", event, fields))


def test_switch_and_finished_lines_name_the_source() -> None:
    log = Lines()
    sink = StructlogTelemetrySink(log)
    sink.emit("r1", SourceSwitched(old="dspark", new="baseline", reason="in request: slower than plain"))
    sink.emit("r1", RoundFinished(index=0, source="none", cap=0, drafted=0, accepted=0, committed=1,
                                  draft_s=0.0, verify_s=0.01, depth=5))  # fmt: skip
    usage = Usage(prompt_tokens=5, generated_tokens=2, rounds=1, decode_s=0.01, source="baseline")
    sink.emit("r1", Finished(reason=FinishReason.LENGTH, usage=usage))
    infos = [(event, fields) for level, event, fields in log.lines if level == "info"]
    assert infos[0] == (
        "draft_source.switched",
        {"request_id": "r1", "old": "dspark", "new": "baseline", "reason": "in request: slower than plain"},
    )
    event, fields = infos[1]
    assert event == "request.finished" and fields["source"] == "baseline" and fields["finish_reason"] == "length"
    assert fields["cap_histogram"] == {0: 1}
