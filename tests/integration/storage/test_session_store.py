"""The SQLite session store: transactions, concurrent writers (threads and processes), crash durability."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mlx_dspark.adapters.storage.sessions import SqliteSessionStore


def test_sessions_and_messages_round_trip(tmp_path: Path) -> None:
    store = SqliteSessionStore(tmp_path / "s.db")
    a = store.create("first", {"mode": "lookup"})
    b = store.create("second")
    store.append(a.id, "user", "hello")
    m = store.append(a.id, "assistant", "hi!", thinking="greet", stats={"tok_s": 12.5})
    assert [s.id for s in store.sessions()] == [a.id, b.id]  # most recently updated first
    got = store.messages(a.id)
    assert [(x.role, x.content) for x in got] == [("user", "hello"), ("assistant", "hi!")]
    assert got[1].thinking == "greet" and got[1].stats == {"tok_s": 12.5} and got[1].id == m.id
    info = store.get(a.id)
    assert info is not None and info.messages == 2 and info.settings == {"mode": "lookup"}
    assert store.rename(b.id, "renamed") and store.get(b.id).title == "renamed"  # type: ignore[union-attr]
    assert store.delete(a.id) and store.get(a.id) is None
    assert store.messages(a.id) == []  # messages go with their session (foreign key cascade)
    assert not store.delete(a.id) and not store.rename(a.id, "x")
    with pytest.raises(KeyError):
        store.append(a.id, "user", "orphan")


def test_a_failed_write_commits_nothing(tmp_path: Path) -> None:
    store = SqliteSessionStore(tmp_path / "s.db")
    s = store.create("t")
    with pytest.raises(RuntimeError), store._write() as db:
        db.execute("INSERT INTO messages (session_id, role, content, created) VALUES (?, 'user', 'half', 0)", (s.id,))
        raise RuntimeError("crash between the two statements of one write")
    assert store.messages(s.id) == []


def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    first = SqliteSessionStore(path)
    sid = first.create("busy").id
    stores = [first, SqliteSessionStore(path)]  # two store objects, as two servers on one file would have
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(25):
                stores[n % 2].append(sid, "user", f"w{n}-{i}")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    got = first.messages(sid)
    assert len(got) == 200 and len({m.id for m in got}) == 200
    for n in range(8):  # each writer's messages are in its own order
        mine = [m.content for m in got if m.content.startswith(f"w{n}-")]
        assert mine == [f"w{n}-{i}" for i in range(25)]


WRITER = """
import sys
from mlx_dspark.adapters.storage.sessions import SqliteSessionStore
store = SqliteSessionStore(sys.argv[1])
sid = sys.argv[2]
for i in range(100000):
    store.append(sid, "user", "%s%d" % (sys.argv[3], i))
    print(i, flush=True)  # printed only after the commit returned
"""


def test_other_processes_write_concurrently_and_a_killed_writer_loses_no_committed_message(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = SqliteSessionStore(path)
    sid = store.create("crash").id
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(path), sid, tag], stdout=subprocess.PIPE, text=True)
        for tag in ("a", "b")
    ]
    acknowledged = []
    for p in procs:
        assert p.stdout is not None
        last = -1
        for _ in range(30):  # read 30 acknowledged commits, then kill the writer mid-stream
            last = int(p.stdout.readline())
        acknowledged.append(last)
        os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait(30)
    contents = [m.content for m in store.messages(sid)]
    assert len(contents) >= sum(n + 1 for n in acknowledged)
    for tag, n in zip("ab", acknowledged):
        mine = [c for c in contents if c.startswith(tag)]
        assert mine[: n + 1] == [f"{tag}{i}" for i in range(n + 1)]  # every acknowledged message survived the kill
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
