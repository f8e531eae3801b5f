"""Chat sessions in SQLite: WAL journal, one transaction per write, safe for concurrent writers.

Each call opens its own connection (cheap for SQLite), so the store is usable from any thread and from
several processes; `BEGIN IMMEDIATE` serializes writers and `busy_timeout` makes them wait, not fail.
`synchronous=FULL` means a committed message survives a crash or power loss.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from mlx_dspark.domain.dashboard import SessionInfo, StoredMessage

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    title TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    settings TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    thinking TEXT NOT NULL DEFAULT '',
    stats TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_session ON messages(session_id, id);
"""


class SqliteSessionStore:
    """The SessionStore port over one SQLite file.

    Args:
        path: the database file (its folder is created).
        timeout_s: how long a writer waits for another writer's transaction.
    """

    def __init__(self, path: str | Path, *, timeout_s: float = 30.0) -> None:
        self.path = Path(path)
        self._timeout = timeout_s
        self._ready = False  # the file is created on first use, not when the server starts

    def _ensure(self, db: sqlite3.Connection) -> None:
        if not self._ready:
            db.executescript("BEGIN IMMEDIATE;" + _SCHEMA + "COMMIT;")
            self._ready = True

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=self._timeout, isolation_level=None)
        try:
            db.row_factory = sqlite3.Row
            db.execute(f"PRAGMA busy_timeout={int(self._timeout * 1000)}")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA foreign_keys=ON")
            self._ensure(db)
            yield db
        finally:
            db.close()

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: all of it commits, or none of it (rolled back on any error)."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def create(self, title: str, settings: Mapping[str, Any] | None = None) -> SessionInfo:
        now = time.time()
        sid = uuid.uuid4().hex
        with self._write() as db:
            db.execute(
                "INSERT INTO sessions (id, title, created, updated, settings) VALUES (?, ?, ?, ?, ?)",
                (sid, title, now, now, json.dumps(dict(settings or {}))),
            )
        return SessionInfo(id=sid, title=title, created=now, updated=now, settings=dict(settings or {}))

    def get(self, session_id: str) -> SessionInfo | None:
        with self._connect() as db:
            row = db.execute(
                "SELECT s.*, (SELECT COUNT(*) FROM messages m WHERE m.session_id = s.id) AS n "
                "FROM sessions s WHERE s.id = ?",
                (session_id,),
            ).fetchone()
        return _session(row) if row else None

    def sessions(self) -> list[SessionInfo]:
        with self._connect() as db:
            rows = db.execute(
                "SELECT s.*, (SELECT COUNT(*) FROM messages m WHERE m.session_id = s.id) AS n "
                "FROM sessions s ORDER BY s.updated DESC"
            ).fetchall()
        return [_session(r) for r in rows]

    def rename(self, session_id: str, title: str) -> bool:
        with self._write() as db:
            cur = db.execute(
                "UPDATE sessions SET title = ?, updated = ? WHERE id = ?", (title, time.time(), session_id)
            )
        return cur.rowcount > 0

    def update_settings(self, session_id: str, settings: Mapping[str, Any]) -> bool:
        with self._write() as db:
            cur = db.execute(
                "UPDATE sessions SET settings = ?, updated = ? WHERE id = ?",
                (json.dumps(dict(settings)), time.time(), session_id),
            )
        return cur.rowcount > 0

    def delete(self, session_id: str) -> bool:
        with self._write() as db:
            cur = db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
        return cur.rowcount > 0

    def truncate(self, session_id: str, message_id: int) -> int:
        """Remove message `message_id` and every later one of the session, in one transaction; returns how many.

        Raises:
            KeyError: no such session.
        """
        with self._write() as db:
            cur = db.execute("UPDATE sessions SET updated = ? WHERE id = ?", (time.time(), session_id))
            if cur.rowcount == 0:
                raise KeyError(session_id)
            cur = db.execute("DELETE FROM messages WHERE session_id = ? AND id >= ?", (session_id, message_id))
        return int(cur.rowcount)

    def append(
        self,
        session_id: str,
        role: str,
        content: str,
        *,
        thinking: str = "",
        stats: Mapping[str, Any] | None = None,
    ) -> StoredMessage:
        """Add a message and touch its session in one transaction.

        Raises:
            KeyError: no such session.
        """
        now = time.time()
        with self._write() as db:
            cur = db.execute("UPDATE sessions SET updated = ? WHERE id = ?", (now, session_id))
            if cur.rowcount == 0:
                raise KeyError(session_id)
            cur = db.execute(
                "INSERT INTO messages (session_id, role, content, thinking, stats, created) VALUES (?, ?, ?, ?, ?, ?)",
                (session_id, role, content, thinking, json.dumps(dict(stats or {})), now),
            )
            mid = int(cur.lastrowid or 0)
        return StoredMessage(
            id=mid, session_id=session_id, role=role, content=content, thinking=thinking, stats=dict(stats or {}),
            created=now,
        )  # fmt: skip

    def messages(self, session_id: str) -> list[StoredMessage]:
        with self._connect() as db:
            rows = db.execute("SELECT * FROM messages WHERE session_id = ? ORDER BY id", (session_id,)).fetchall()
        return [
            StoredMessage(
                id=r["id"],
                session_id=r["session_id"],
                role=r["role"],
                content=r["content"],
                thinking=r["thinking"],
                stats=json.loads(r["stats"] or "{}"),
                created=r["created"],
            )
            for r in rows
        ]


def _session(row: sqlite3.Row) -> SessionInfo:
    return SessionInfo(
        id=row["id"],
        title=row["title"],
        created=row["created"],
        updated=row["updated"],
        settings=json.loads(row["settings"] or "{}"),
        messages=int(row["n"]),
    )
