"""`mlx-dspark generate` as a person and a script see it: text streams to a terminal as it is produced,
`--json` is one clean object on stdout, and nothing else is printed when not on a terminal or --quiet."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import pty
import sys
import threading
from collections.abc import Iterator

import pytest

from mlx_dspark.application import bootstrap
from mlx_dspark.entrypoints.cli import generate
from tests.fakes.clock import FakeClock, RecordingTelemetrySink
from tests.fakes.scripted import ScriptedLoader
from tests.unit.cli.terminal import read_pty

REPLY = "Streaming, one piece at a time."


@pytest.fixture
def loader(monkeypatch: pytest.MonkeyPatch) -> ScriptedLoader:
    """The CLI's own composition, with the scripted model in place of the real loader."""
    fake = ScriptedLoader(lambda prompt: REPLY)
    build = functools.partial(
        bootstrap.build, loader=fake, telemetry=RecordingTelemetrySink(), clock=FakeClock(), calibration=object()
    )
    monkeypatch.setattr(bootstrap, "build", build)
    return fake


@contextlib.contextmanager
def terminal() -> Iterator[int]:
    """stdout and stderr on one pty, as in a terminal; yields the master side.

    Set inside the test body: pytest's capture re-installs its own sys.stdout after fixture setup.
    """
    master, slave = pty.openpty()
    tty = os.fdopen(slave, "w", buffering=1)
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = tty
    try:
        yield master
    finally:
        sys.stdout, sys.stderr = saved
        tty.close()
        os.close(master)


def test_text_streams_to_a_terminal_as_it_is_produced(loader: ScriptedLoader) -> None:
    gate = threading.Event()
    loader.target.gate = gate  # every verify waits: the model is stopped after its first token
    codes: list[int] = []
    with terminal() as screen:
        run = threading.Thread(
            target=lambda: codes.append(generate.main(["--prompt", "hi", "--mode", "baseline", "--max-tokens", "64"]))
        )
        run.start()
        try:
            assert loader.target.reached_gate.wait(30)
            before = read_pty(screen).decode()
            assert REPLY[0] in before and REPLY not in before  # the first token is on screen, the rest not yet
        finally:
            gate.set()
            run.join(30)
        after = before + read_pty(screen).decode()
    assert codes == [0] and REPLY in after.replace("\r", "")


def test_json_is_one_clean_object_on_stdout(loader: ScriptedLoader, capsys: pytest.CaptureFixture[str]) -> None:
    assert generate.main(["--prompt", "hi", "--mode", "baseline", "--json"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and out.count("\n") == 1
    assert json.loads(out)["text"] == REPLY
    assert err == ""  # not a terminal: no progress, no summary


def test_quiet_on_a_terminal_prints_only_the_text(loader: ScriptedLoader) -> None:
    with terminal() as screen:
        assert generate.main(["--prompt", "hi", "--mode", "baseline", "--quiet"]) == 0
        shown = read_pty(screen).decode().replace("\r", "")
    assert shown == REPLY + "\n"


def test_not_a_terminal_prints_only_the_text(
    loader: ScriptedLoader, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    assert generate.main(["--prompt", "hi", "--mode", "baseline"]) == 0
    assert out.getvalue() == REPLY + "\n" and err.getvalue() == ""


def test_every_sampling_flag_says_what_it_does(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        generate.parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, words in [("--top-p", "probability"), ("--top-k", "most likely"), ("--seed", "same tokens")]:
        entry = text.split(f" {flag} {flag[2:].replace('-', '_').upper()} ")[1].split(" --")[0]
        assert words in entry, (flag, entry)


def test_an_auto_summary_names_where_its_rounds_went() -> None:
    # The summary line used to name only the last source ("mode auto (dspark)") after announcing the race's.
    assert generate.ran_on({"lookup": 4, "dspark": 30, "baseline": 2}) == "dspark 30 rounds, lookup 4, baseline 2"
    assert generate.ran_on({"dspark": 7}) == "dspark 7 rounds"
