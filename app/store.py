"""The Playground's experiments, kept in a SQLite database (stdlib ``sqlite3``) in the data folder.

An experiment is the code, the shape, the seed, the latest result of each kind (Check, Gradients,
Benchmark, ...) and where they were computed (commit and environment).

- Every write is one transaction (``BEGIN IMMEDIATE``): a crash leaves the last committed state.
- Writes are optimistic: each experiment carries a revision number, a write names the revision it
  started from, and a write against an older revision is refused with :class:`StaleWriteError`, so
  two browser tabs never overwrite each other silently.
- The schema carries a version (``PRAGMA user_version``); opening a database applies the missing
  :data:`MIGRATIONS` in one transaction, and a database written by a newer schema is refused.

Example:
    >>> store = Store(Path("~/.flexlab/experiments.sqlite3").expanduser())
    >>> exp = store.create("causal", code, shape, seed=0)
    >>> exp = store.save(exp.id, exp.revision, code=new_code)
"""
from __future__ import annotations

import json
import secrets
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

#: The kind string of an exported experiment (JSON).
EXPORT_KIND = "flexlab-experiment"
EXPORT_VERSION = 1
DB_NAME = "experiments.sqlite3"


class StoreError(Exception):
    """The store cannot do what was asked; the message says why and what to do."""


class StaleWriteError(StoreError):
    """The experiment changed since the caller read it (another tab or window saved it)."""

    def __init__(self, experiment_id: str, expected: int, current: int):
        super().__init__(
            f"Experiment {experiment_id} was saved elsewhere (another tab or window) after you "
            f"opened it: it is at revision {current}, you started from revision {expected}. "
            "Nothing was overwritten. Load the saved version, or keep yours as a copy.")
        self.experiment_id, self.expected, self.current = experiment_id, expected, current


class NotFoundError(StoreError):
    """No experiment has this id (deleted, or from another data folder)."""


@dataclass(frozen=True)
class Experiment:
    """One saved experiment.

    Attributes:
        results: ``{kind: record}``; a record is JSON data with at least ``fingerprint`` (the hash
            of the code, shape and seed it was computed from, see ``app.services.fingerprint``).
        revision: increases by one with every write.
        commit, environment: where it was last saved (git commit, versions and device).
    """

    id: str
    name: str
    code: str
    shape: dict
    seed: int
    revision: int
    created: float
    updated: float
    results: dict = field(default_factory=dict)
    commit: str | None = None
    environment: dict | None = None


def _v1(db: sqlite3.Connection) -> None:
    """Experiments and their latest result of each kind."""
    db.execute("""CREATE TABLE experiments (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        code TEXT NOT NULL,
        shape TEXT NOT NULL,
        seed INTEGER NOT NULL DEFAULT 0,
        revision INTEGER NOT NULL DEFAULT 1,
        created REAL NOT NULL,
        updated REAL NOT NULL)""")
    db.execute("""CREATE TABLE results (
        experiment_id TEXT NOT NULL REFERENCES experiments(id) ON DELETE CASCADE,
        kind TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        created REAL NOT NULL,
        payload TEXT NOT NULL,
        PRIMARY KEY (experiment_id, kind))""")


def _v2(db: sqlite3.Connection) -> None:
    """Provenance of each experiment (git commit, environment) and listing by last change."""
    db.execute("ALTER TABLE experiments ADD COLUMN git_commit TEXT")
    db.execute("ALTER TABLE experiments ADD COLUMN environment TEXT")
    db.execute("CREATE INDEX experiments_by_update ON experiments(updated DESC)")


#: Migration i brings a database from version i to i + 1; the list's length is the schema version.
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_v1, _v2)


def schema_version(db: sqlite3.Connection) -> int:
    return int(db.execute("PRAGMA user_version").fetchone()[0])


def migrate(db: sqlite3.Connection, migrations=MIGRATIONS) -> int:
    """Apply the missing migrations in one transaction; return the new version.

    Raises:
        StoreError: the database was written by a newer schema than this code knows.
    """
    db.execute("BEGIN IMMEDIATE")
    try:
        version = schema_version(db)
        if version > len(migrations):
            raise StoreError(
                f"The experiments database has schema version {version}, newer than this flexlab "
                f"knows ({len(migrations)}). Update flexlab, or choose another data folder "
                "(FLEXLAB_DATA_DIR or --data-dir).")
        for step in migrations[version:]:
            step(db)
        # PRAGMA takes no parameters; the value is an int from len().
        db.execute(f"PRAGMA user_version = {len(migrations)}")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    return len(migrations)


def _new_id() -> str:
    return secrets.token_hex(4)


class Store:
    """The experiments database at ``path`` (created and migrated on first use).

    Each call opens its own connection, so a Store may be shared between threads and processes.
    """

    def __init__(self, path: str | Path, migrations=MIGRATIONS):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.execute("PRAGMA journal_mode = WAL")  # readers never wait for the writer
            migrate(db, migrations)

    @classmethod
    def in_folder(cls, folder: str | Path) -> "Store":
        return cls(Path(folder) / DB_NAME)

    def _connect(self) -> "_Connection":
        return _Connection(self.path)

    # ---- reading ------------------------------------------------------------------------------
    def list(self) -> list[dict]:
        """``[{"id", "name", "updated", "revision"}]``, the latest change first."""
        with self._connect() as db:
            rows = db.execute("SELECT id, name, updated, revision FROM experiments "
                              "ORDER BY updated DESC, id").fetchall()
        return [dict(zip(("id", "name", "updated", "revision"), r)) for r in rows]

    def get(self, experiment_id: str) -> Experiment:
        with self._connect() as db:
            return self._get(db, experiment_id)

    def _get(self, db: sqlite3.Connection, experiment_id: str) -> Experiment:
        row = db.execute("SELECT id, name, code, shape, seed, revision, created, updated, "
                         "git_commit, environment FROM experiments WHERE id = ?",
                         (experiment_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"No experiment {experiment_id!r} in {self.path} (deleted, or "
                                "saved in another data folder).")
        results = {kind: json.loads(payload) for kind, payload in db.execute(
            "SELECT kind, payload FROM results WHERE experiment_id = ? ORDER BY kind",
            (experiment_id,))}
        return Experiment(row[0], row[1], row[2], json.loads(row[3]), row[4], row[5], row[6],
                          row[7], results, row[8], json.loads(row[9]) if row[9] else None)

    # ---- writing ------------------------------------------------------------------------------
    def create(self, name: str, code: str, shape: dict, seed: int = 0,
               results: dict | None = None, commit: str | None = None,
               environment: dict | None = None) -> Experiment:
        """A new experiment at revision 1."""
        now = time.time()
        with self._connect() as db, _transaction(db):
            experiment_id = _new_id()
            while db.execute("SELECT 1 FROM experiments WHERE id = ?", (experiment_id,)).fetchone():
                experiment_id = _new_id()
            db.execute("INSERT INTO experiments (id, name, code, shape, seed, revision, created, "
                       "updated, git_commit, environment) VALUES (?, ?, ?, ?, ?, 1, ?, ?, ?, ?)",
                       (experiment_id, name, code, json.dumps(shape), int(seed), now, now, commit,
                        _json_or_none(environment)))
            self._put_results(db, experiment_id, results or {}, now)
            return self._get(db, experiment_id)

    def save(self, experiment_id: str, revision: int, *, name: str | None = None,
             code: str | None = None, shape: dict | None = None, seed: int | None = None,
             results: dict | None = None, drop_results: tuple[str, ...] = (),
             commit: str | None = None, environment: dict | None = None) -> Experiment:
        """Write the given fields if the experiment is still at ``revision``; return it at the next.

        Args:
            results: ``{kind: record}`` replacing those kinds' records (other kinds are kept).
            drop_results: kinds whose records are removed.

        Raises:
            StaleWriteError: someone saved the experiment after ``revision``; nothing is written.
            NotFoundError: it was deleted.
        """
        now = time.time()
        with self._connect() as db, _transaction(db):
            row = db.execute("SELECT revision FROM experiments WHERE id = ?",
                             (experiment_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"Experiment {experiment_id!r} was deleted (in another tab?). "
                                    "Keep your work as a new experiment.")
            if row[0] != revision:
                raise StaleWriteError(experiment_id, revision, row[0])
            columns = {"name": name, "code": code, "seed": None if seed is None else int(seed),
                       "shape": None if shape is None else json.dumps(shape),
                       "git_commit": commit, "environment": _json_or_none(environment)}
            sets = [f"{k} = ?" for k, v in columns.items() if v is not None]
            values = [v for v in columns.values() if v is not None]
            sets += ["revision = revision + 1", "updated = ?"]
            db.execute(f"UPDATE experiments SET {', '.join(sets)} WHERE id = ? AND revision = ?",
                       (*values, now, experiment_id, revision))
            for kind in drop_results:
                db.execute("DELETE FROM results WHERE experiment_id = ? AND kind = ?",
                           (experiment_id, kind))
            self._put_results(db, experiment_id, results or {}, now)
            return self._get(db, experiment_id)

    @staticmethod
    def _put_results(db: sqlite3.Connection, experiment_id: str, results: dict, now: float) -> None:
        for kind, record in results.items():
            if not isinstance(record, dict) or not record.get("fingerprint"):
                raise StoreError(f"result {kind!r} has no fingerprint: a result must say which code, "
                                 "shape and seed it was computed from")
            db.execute("INSERT OR REPLACE INTO results (experiment_id, kind, fingerprint, created, "
                       "payload) VALUES (?, ?, ?, ?, ?)",
                       (experiment_id, kind, record["fingerprint"], now, json.dumps(record)))

    def rename(self, experiment_id: str, revision: int, name: str) -> Experiment:
        name = name.strip()
        if not name:
            raise StoreError("An experiment needs a name; type one and press Rename again.")
        return self.save(experiment_id, revision, name=name)

    def duplicate(self, experiment_id: str, name: str | None = None) -> Experiment:
        """A copy at revision 1 (results included), named ``<name> (copy)`` by default."""
        exp = self.get(experiment_id)
        return self.create(name or f"{exp.name} (copy)", exp.code, exp.shape, exp.seed,
                           exp.results, exp.commit, exp.environment)

    def delete(self, experiment_id: str) -> None:
        with self._connect() as db, _transaction(db):
            deleted = db.execute("DELETE FROM experiments WHERE id = ?", (experiment_id,)).rowcount
            db.execute("DELETE FROM results WHERE experiment_id = ?", (experiment_id,))
        if not deleted:
            raise NotFoundError(f"No experiment {experiment_id!r} to delete.")

    # ---- JSON ---------------------------------------------------------------------------------
    def export_json(self, experiment_id: str) -> str:
        return json.dumps(as_export(self.get(experiment_id)), indent=1)

    def import_json(self, text: str | bytes) -> Experiment:
        """A new experiment from an exported one (see :func:`parse_export`)."""
        data = parse_export(text)
        return self.create(data["name"], data["code"], data["shape"], data["seed"],
                           data["results"], data.get("commit"), data.get("environment"))


class _Connection:
    """A connection in autocommit mode (transactions are explicit), closed on exit."""

    def __init__(self, path: Path):
        self.db = sqlite3.connect(path, timeout=30, isolation_level=None)
        self.db.execute("PRAGMA foreign_keys = ON")
        self.db.execute("PRAGMA busy_timeout = 30000")

    def __enter__(self) -> sqlite3.Connection:
        return self.db

    def __exit__(self, *exc) -> None:
        self.db.close()


class _transaction:
    """``BEGIN IMMEDIATE`` (the write lock from the start, so two writers queue rather than
    deadlock) ... ``COMMIT``, or ``ROLLBACK`` on any error."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self):
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, *_):
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")


def _json_or_none(value) -> str | None:
    return None if value is None else json.dumps(value)


def as_export(exp: Experiment) -> dict:
    """An experiment as exported JSON data (what :func:`parse_export` reads back)."""
    return {"kind": EXPORT_KIND, "version": EXPORT_VERSION, "name": exp.name, "code": exp.code,
            "shape": exp.shape, "seed": exp.seed, "results": exp.results, "commit": exp.commit,
            "environment": exp.environment, "created": exp.created, "updated": exp.updated}


_SHAPE_KEYS = ("B", "Hq", "Hkv", "Q_LEN", "KV_LEN", "D")


def parse_export(text: str | bytes) -> dict[str, Any]:
    """Read an exported experiment, checking each field.

    Raises:
        StoreError: not JSON, not an experiment, or a field is missing or of the wrong type.
    """
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise StoreError(f"The file is not JSON ({e}); choose a file exported by flexlab.") from None
    if not isinstance(data, dict) or data.get("kind") not in (EXPORT_KIND,
                                                                "flexlab-playground-experiment"):
        raise StoreError(f"The file is not a flexlab experiment (its 'kind' is "
                         f"{data.get('kind') if isinstance(data, dict) else type(data).__name__!r}; "
                         f"expected {EXPORT_KIND!r}).")
    if isinstance(data.get("version"), int) and data["version"] > EXPORT_VERSION:
        raise StoreError(f"The experiment was exported by a newer flexlab (format version "
                         f"{data['version']}, this one reads {EXPORT_VERSION}).")
    if not isinstance(data.get("code"), str):
        raise StoreError("The experiment has no 'code' text.")
    shape = data.get("shape")
    if not isinstance(shape, dict) or any(not isinstance(shape.get(k), int) for k in _SHAPE_KEYS):
        raise StoreError(f"The experiment's 'shape' must hold integers {', '.join(_SHAPE_KEYS)}; "
                         f"got {shape!r}.")
    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise StoreError(f"The experiment's 'seed' must be an integer; got {seed!r}.")
    results = data.get("results") or {}
    if not isinstance(results, dict):
        raise StoreError("The experiment's 'results' must be a mapping of kind to record.")
    # Results without a fingerprint (older exports) cannot be tied to their code: they are dropped.
    results = {k: v for k, v in results.items() if isinstance(v, dict) and v.get("fingerprint")}
    name = data.get("name") if isinstance(data.get("name"), str) and data["name"].strip() else \
        "imported experiment"
    env = data.get("environment") if isinstance(data.get("environment"), dict) else None
    commit = data.get("commit") if isinstance(data.get("commit"), str) else None
    return {"name": name, "code": data["code"], "shape": shape, "seed": seed, "results": results,
            "commit": commit, "environment": env}
