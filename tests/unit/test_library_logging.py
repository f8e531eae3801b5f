"""The Python API as a library: it prints nothing to its caller's stdout, keeps warnings on stderr, and leaves a
caller's own structlog configuration alone. Each case runs in a fresh interpreter (structlog's configuration is
process-wide)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60, check=True
    )


def test_unconfigured_the_library_logs_warnings_on_stderr_and_nothing_on_stdout() -> None:
    out = _run(
        """
        import structlog
        from mlx_dspark.entrypoints.log_config import library_logging
        library_logging()
        log = structlog.get_logger("mlx_dspark.telemetry")
        log.debug("round", accepted=2)
        log.info("request.finished", tokens=16)
        log.warning("engine.warm_up_failed", error="x" * 5000)
        """
    )
    assert out.stdout == ""  # structlog's own default printed both lines above to stdout
    assert "engine.warm_up_failed" in out.stderr and "round" not in out.stderr and "request.finished" not in out.stderr
    assert len(out.stderr) < 2000  # values bounded as in every other log


def test_a_callers_own_structlog_configuration_is_kept() -> None:
    out = _run(
        """
        import structlog
        structlog.configure(processors=[structlog.processors.JSONRenderer()])
        from mlx_dspark.entrypoints.log_config import library_logging
        library_logging()
        structlog.get_logger().debug("mine", n=1)
        """
    )
    assert '"event": "mine"' in out.stdout
