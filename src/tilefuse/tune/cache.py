"""The tuning cache: one SQLite file (WAL) of tuned knobs, keyed by device and kernel structure.

key = device name + compute capability + NVRTC version + family (+ its version) + the
kernel's structural hash (names and independent statement order do not change it) + its
shape/dtype signature. So a model's 24 identical RMSNorms share one entry, and a different
shape, dtype, GPU or toolkit is a different one. Value: knobs, timing statistics, the
candidates that failed and why.

Several tuners may write at once (WAL, a busy timeout, one short transaction per write).
Opening checks the file once per process, under a lock file: a file that is not a
database, fails `PRAGMA quick_check`, or has another schema version is moved aside
(`tune.sqlite.bad`) and rebuilt with a warning. An error while reading later means the
same recovery and a miss, never a crash.

Path: $TILEFUSE_CACHE_DIR/tune.sqlite, else ~/.cache/tilefuse/tune.sqlite.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sqlite3
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from .. import env

SCHEMA = 1
_checked: set = set()  # (pid, path) already validated in this process
_writes = 0  # entries put or deleted by this process (`state`)


def default_path() -> Path:
    folder = env.raw("TILEFUSE_CACHE_DIR")
    base = Path(folder).expanduser() if folder else Path.home() / ".cache" / "tilefuse"
    return base / "tune.sqlite"


def state() -> tuple:
    """What a lookup in this process can answer depends on: the cache's path, TILEFUSE_TUNED,
    and the entries this process wrote or deleted since (a count). For callers that keep what
    an earlier lookup gave (runtime.program's shared kernels). Another process tuning
    meanwhile is seen by kernels this process has not compiled yet; the file's own state is
    no key: opening it for a read creates it, and SQLite's WAL files come and go on reads."""
    return str(default_path()), env.switch("TILEFUSE_TUNED"), _writes


def _wrote() -> None:
    global _writes
    _writes += 1


def signature(kernel) -> str:
    """Roles, dtypes and shapes of the kernel's buffers, in parameter order (no names)."""
    return ",".join(f"{b.role}:{b.dtype}[{'x'.join(map(str, b.shape))}]" for b in kernel.params)


@dataclass(frozen=True)
class Key:
    device: str
    capability: str
    toolkit: str
    family: str
    family_version: str
    khash: str
    signature: str

    @property
    def digest(self) -> str:
        return hashlib.sha256("\x1f".join((self.device, self.capability, self.toolkit, self.family,
                                           self.family_version, self.khash, self.signature)).encode()).hexdigest()


def key_for(kernel, device, family) -> Key:
    """The cache key of `kernel` on `device` (a tune.device.Device) for `family` (a Family)."""
    khash, sig = family.describe(kernel)
    return Key(device.name, device.capability, device.toolkit, family.name, family.version, khash, sig)


@dataclass(frozen=True)
class Entry:
    key: Key
    knobs: dict
    stats: dict = field(default_factory=dict)       # median_us, default_us, evaluated, wall_s, ...
    failures: tuple = ()                             # ({"knobs": ..., "reason": ...}, ...)
    created: float = 0.0


_TABLES = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tuned (
    digest TEXT PRIMARY KEY, device TEXT NOT NULL, capability TEXT NOT NULL, toolkit TEXT NOT NULL,
    family TEXT NOT NULL, family_version TEXT NOT NULL, khash TEXT NOT NULL, signature TEXT NOT NULL,
    knobs TEXT NOT NULL, stats TEXT NOT NULL, failures TEXT NOT NULL, created REAL NOT NULL);
"""


class TuneCache:
    def __init__(self, path: Path | str | None = None, timeout: float = 30.0):
        self.path = Path(path) if path is not None else default_path()
        self.timeout = timeout

    # ---------------------------------------------------------------- opening and recovery
    def _connect(self) -> sqlite3.Connection:
        con = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None)
        con.execute(f"PRAGMA busy_timeout = {int(self.timeout * 1000)}")
        con.execute("PRAGMA synchronous = NORMAL")  # with WAL: durable across crashes of the process
        return con

    @contextlib.contextmanager
    def _file_lock(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(str(self.path) + ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _problem(self) -> str | None:
        """Why the file cannot be used as it is (None: it is fine or absent)."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return None
        try:
            con = self._connect()
            try:
                rows = con.execute("PRAGMA quick_check").fetchall()
                if rows != [("ok",)]:
                    return f"integrity check failed: {rows[0][0]}"
                names = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
                if "meta" not in names:
                    return "not a tilefuse tuning cache (no meta table)"
                row = con.execute("SELECT value FROM meta WHERE name='schema'").fetchone()
                if row is None or row[0] != str(SCHEMA):
                    return f"schema version {row[0] if row else 'unknown'}, this tilefuse uses {SCHEMA}"
            finally:
                con.close()
        except sqlite3.DatabaseError as e:
            return f"unreadable: {e}"
        return None

    def _rebuild(self, why: str):
        bad = Path(str(self.path) + ".bad")
        for suffix in ("-wal", "-shm", "-journal"):
            Path(str(self.path) + suffix).unlink(missing_ok=True)
        if self.path.exists():
            os.replace(self.path, bad)
        warnings.warn(f"tilefuse: tuning cache {self.path} was {why}; moved it to {bad.name} and started an "
                      f"empty one (tuned schedules are re-measured on the next `tilefuse tune`)",
                      RuntimeWarning, stacklevel=3)

    def _create(self):
        con = self._connect()
        try:
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("BEGIN IMMEDIATE")
            for stmt in _TABLES.split(";"):
                if stmt.strip():
                    con.execute(stmt)
            con.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA),))
            con.execute("COMMIT")
        finally:
            con.close()

    def _ensure(self, force_check: bool = False):
        tag = (os.getpid(), str(self.path))
        if tag in _checked and not force_check:
            return
        with self._file_lock():
            why = self._problem()
            if why:
                self._rebuild(why)
            self._create()
        _checked.add(tag)

    def _recover(self, e: Exception):
        _checked.discard((os.getpid(), str(self.path)))
        with self._file_lock():
            why = self._problem() or f"unreadable: {e}"
            self._rebuild(why)
            self._create()
        _checked.add((os.getpid(), str(self.path)))

    def _do(self, fn, default=None, retry: bool = True):
        """Run fn(connection); on a corrupted file recover (rebuild) and retry once."""
        try:
            self._ensure()
            con = self._connect()
            try:
                return fn(con)
            finally:
                con.close()
        except sqlite3.OperationalError as e:
            if "locked" in str(e) or "busy" in str(e):  # busier than the timeout: skip, say so
                warnings.warn(f"tilefuse: tuning cache {self.path} stayed locked for {self.timeout:g} s; "
                              f"going on without it", RuntimeWarning, stacklevel=3)
                return default
            if not retry:
                return default
            self._recover(e)
            return self._do(fn, default, retry=False)
        except sqlite3.DatabaseError as e:
            if not retry:
                return default
            self._recover(e)
            return self._do(fn, default, retry=False)

    # ---------------------------------------------------------------- reading and writing
    def get(self, key: Key) -> Entry | None:
        def q(con):
            row = con.execute("SELECT knobs, stats, failures, created FROM tuned WHERE digest=?",
                              (key.digest,)).fetchone()
            if row is None:
                return None
            return Entry(key, json.loads(row[0]), json.loads(row[1]), tuple(json.loads(row[2])), row[3])

        try:
            return self._do(q)
        except (ValueError, TypeError):  # a row whose JSON does not parse: a miss
            return None

    def put(self, entry: Entry) -> None:
        k = entry.key

        def w(con):
            con.execute("BEGIN IMMEDIATE")
            con.execute("INSERT OR REPLACE INTO tuned VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                        (k.digest, k.device, k.capability, k.toolkit, k.family, k.family_version, k.khash,
                         k.signature, json.dumps(entry.knobs), json.dumps(entry.stats, sort_keys=True),
                         json.dumps(list(entry.failures)), entry.created or time.time()))
            con.execute("COMMIT")

        self._do(w)
        _wrote()

    def delete(self, key: Key) -> None:
        def w(con):
            con.execute("DELETE FROM tuned WHERE digest=?", (key.digest,))

        self._do(w)
        _wrote()

    def entries(self) -> list[Entry]:
        def q(con):
            out = []
            for r in con.execute("SELECT device, capability, toolkit, family, family_version, khash, signature, "
                                 "knobs, stats, failures, created FROM tuned ORDER BY created"):
                out.append(Entry(Key(*r[:7]), json.loads(r[7]), json.loads(r[8]), tuple(json.loads(r[9])), r[10]))
            return out

        return self._do(q, default=[])
