"""The step engine: requests as rows stepped together (`step.py`; each request's decode loop is the domain's
`RequestDecoder`), the rows port over a one-request target (`rows.py`), the batch's speculation plan
(`plan.py`), job events (`jobs.py`) and the engine thread that owns all model work (`thread.py`)."""

from mlx_dspark.application.engine.jobs import JobEnded, JobEvent, JobFailed, JobItem, StepJob
from mlx_dspark.application.engine.plan import TELEMETRY_ID, WidthPlan
from mlx_dspark.application.engine.rows import Row, RowsBackend, SerialRows
from mlx_dspark.application.engine.step import Engine, NoTelemetry, Task, decode, forkable, speculates
from mlx_dspark.application.engine.thread import (
    EngineDown,
    EngineJob,
    EngineRestarted,
    EngineThread,
    Restart,
    RowsFactory,
    SideBySide,
)
from mlx_dspark.domain.decoder import Draft, Prefill, RequestDecoder, Verify, Work

__all__ = [
    "TELEMETRY_ID",
    "Draft",
    "Engine",
    "EngineDown",
    "EngineJob",
    "EngineRestarted",
    "EngineThread",
    "JobEnded",
    "JobEvent",
    "JobFailed",
    "JobItem",
    "NoTelemetry",
    "Prefill",
    "RequestDecoder",
    "Restart",
    "Row",
    "RowsBackend",
    "RowsFactory",
    "SerialRows",
    "SideBySide",
    "StepJob",
    "Task",
    "Verify",
    "WidthPlan",
    "Work",
    "decode",
    "forkable",
    "speculates",
]
