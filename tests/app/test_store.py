"""The experiments store: schema migrations, transactional and optimistic writes, JSON round trips."""
from __future__ import annotations

import json
import multiprocessing
import sqlite3
import threading

import pytest

from app import store as store_mod
from app.store import (MIGRATIONS, NotFoundError, StaleWriteError, Store, StoreError, migrate,
                       schema_version)

SHAPE = {"B": 1, "Hq": 2, "Hkv": 2, "Q_LEN": 64, "KV_LEN": 64, "D": 16, "dtype": "float32",
         "BLOCK_SIZE": 16}
CODE = "def mask_mod(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\n"
RECORD = {"kind": "check", "fingerprint": "0123456789abcdef", "params": {"dtypes": ["float32"]},
          "data": {"rows": [{"dtype": "float32", "max_abs": 3.1e-07, "passed": True}]}}


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "experiments.sqlite3")


def test_a_version_1_database_is_migrated_with_its_experiments_kept(tmp_path):
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    migrate(db, MIGRATIONS[:1])  # the database as schema version 1 wrote it
    db.execute("INSERT INTO experiments (id, name, code, shape, seed, revision, created, updated) "
               "VALUES ('abcd1234', 'old one', ?, ?, 7, 3, 1.0, 2.0)", (CODE, json.dumps(SHAPE)))
    db.execute("INSERT INTO results VALUES ('abcd1234', 'check', ?, 2.0, ?)",
               (RECORD["fingerprint"], json.dumps(RECORD)))
    db.close()

    s = Store(path)
    with sqlite3.connect(path) as db:
        assert schema_version(db) == len(MIGRATIONS) == 2
    exp = s.get("abcd1234")
    assert (exp.name, exp.code, exp.shape, exp.seed, exp.revision) == ("old one", CODE, SHAPE, 7, 3)
    assert exp.results == {"check": RECORD} and exp.commit is None and exp.environment is None
    # Version 2's columns are usable on the migrated experiment.
    exp = s.save("abcd1234", 3, commit="cafe", environment={"device": "cpu"})
    assert (exp.commit, exp.environment, exp.revision) == ("cafe", {"device": "cpu"}, 4)


def test_a_failing_migration_leaves_the_database_as_it_was(tmp_path):
    path = tmp_path / "x.sqlite3"
    Store(path, MIGRATIONS[:1])

    def broken(db):
        db.execute("ALTER TABLE experiments ADD COLUMN half_done TEXT")
        raise RuntimeError("migration failed midway")

    with pytest.raises(RuntimeError, match="midway"):
        Store(path, (MIGRATIONS[0], broken))
    with sqlite3.connect(path) as db:
        assert schema_version(db) == 1
        columns = [r[1] for r in db.execute("PRAGMA table_info(experiments)")]
    assert "half_done" not in columns  # the ALTER was rolled back with the failure


def test_a_database_from_a_newer_schema_is_refused(tmp_path):
    path = tmp_path / "new.sqlite3"
    Store(path)
    with sqlite3.connect(path) as db:
        db.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    with pytest.raises(StoreError, match="newer than this flexlab knows"):
        Store(path)


def test_a_stale_write_is_refused_and_nothing_is_overwritten(store):
    exp = store.create("two tabs", CODE, SHAPE)
    tab_a = store.get(exp.id)
    tab_b = store.get(exp.id)
    saved = store.save(tab_a.id, tab_a.revision, code=CODE + "# from tab A\n")
    assert saved.revision == tab_a.revision + 1
    with pytest.raises(StaleWriteError, match="saved elsewhere") as info:
        store.save(tab_b.id, tab_b.revision, code=CODE + "# from tab B\n",
                   results={"check": RECORD})
    assert (info.value.expected, info.value.current) == (1, 2)
    now = store.get(exp.id)
    assert now.code.endswith("# from tab A\n") and now.results == {} and now.revision == 2


def test_concurrent_read_modify_write_loses_no_update(store):
    # Eight writers each add 10 lines, rereading after every refused (stale) write: every line
    # must arrive exactly once.
    exp = store.create("counter", "", SHAPE)
    writers, per_writer = 8, 10

    def writer(w: int) -> None:
        mine = Store(store.path)  # its own connections, as another server thread or process
        for i in range(per_writer):
            while True:
                cur = mine.get(exp.id)
                try:
                    mine.save(exp.id, cur.revision, code=cur.code + f"{w}:{i}\n")
                    break
                except StaleWriteError:
                    continue

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = store.get(exp.id)
    lines = final.code.splitlines()
    assert sorted(lines) == sorted(f"{w}:{i}" for w in range(writers) for i in range(per_writer))
    assert final.revision == 1 + writers * per_writer


def _save_from_process(path: str, experiment_id: str, revision: int, queue) -> None:
    try:
        Store(path).save(experiment_id, revision, code="from the other process\n")
        queue.put("saved")
    except StaleWriteError:
        queue.put("stale")


def test_another_process_holding_an_old_revision_is_refused(store):
    exp = store.create("processes", CODE, SHAPE)
    store.save(exp.id, exp.revision, code=CODE + "# newer\n")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_save_from_process, args=(str(store.path), exp.id, exp.revision, queue))
    proc.start()
    proc.join(60)
    assert queue.get(timeout=5) == "stale"
    assert store.get(exp.id).code.endswith("# newer\n")


def test_results_without_a_fingerprint_are_refused(store):
    exp = store.create("x", CODE, SHAPE)
    with pytest.raises(StoreError, match="fingerprint"):
        store.save(exp.id, exp.revision, results={"check": {"data": {}}})
    assert store.get(exp.id).revision == exp.revision  # the refused write changed nothing


def test_export_then_import_gives_the_same_experiment(store):
    exp = store.create("round trip", CODE, SHAPE, seed=42, results={"check": RECORD},
                       commit="abc123", environment={"device": "cpu", "torch": "2.13.0"})
    text = store.export_json(exp.id)
    back = store.import_json(text)
    assert back.id != exp.id and back.revision == 1
    for field in ("name", "code", "shape", "seed", "results", "commit", "environment"):
        assert getattr(back, field) == getattr(exp, field), field
    # Into another data folder too.
    other = Store(store.path.parent / "other" / "e.sqlite3").import_json(text.encode())
    assert (other.code, other.results) == (exp.code, exp.results)


@pytest.mark.parametrize("text, message", [
    ("not json", "not JSON"),
    ('{"kind": "something else"}', "not a flexlab experiment"),
    ('{"kind": "flexlab-experiment", "version": 99, "code": ""}', "newer flexlab"),
    ('{"kind": "flexlab-experiment", "shape": {}}', "no 'code'"),
    ('{"kind": "flexlab-experiment", "code": "x", "shape": {"B": 1}}', "must hold integers"),
    ('{"kind": "flexlab-experiment", "code": "x", "seed": "one", "shape": '
     '{"B": 1, "Hq": 1, "Hkv": 1, "Q_LEN": 8, "KV_LEN": 8, "D": 8}}', "'seed' must be an integer"),
])
def test_imports_of_bad_files_say_what_is_wrong(store, text, message):
    with pytest.raises(StoreError, match=message):
        store.import_json(text)
    assert store.list() == []


def test_rename_duplicate_delete(store):
    exp = store.create("first", CODE, SHAPE, results={"check": RECORD})
    renamed = store.rename(exp.id, exp.revision, "  renamed  ")
    assert renamed.name == "renamed" and renamed.revision == 2
    with pytest.raises(StoreError, match="needs a name"):
        store.rename(exp.id, renamed.revision, "   ")
    copy = store.duplicate(exp.id)
    assert copy.name == "renamed (copy)" and copy.results == {"check": RECORD}
    assert [e["id"] for e in store.list()] == [copy.id, exp.id]  # the latest change first
    store.delete(exp.id)
    with pytest.raises(NotFoundError):
        store.get(exp.id)
    with pytest.raises(NotFoundError, match="deleted"):
        store.save(exp.id, renamed.revision, code="x")
    with sqlite3.connect(store.path) as db:  # its results went with it
        assert db.execute("SELECT COUNT(*) FROM results WHERE experiment_id = ?",
                          (exp.id,)).fetchone()[0] == 0
    assert store.get(copy.id).results == {"check": RECORD}


def test_export_format_names_its_kind_and_version(store):
    exp = store.create("x", CODE, SHAPE)
    data = json.loads(store.export_json(exp.id))
    assert data["kind"] == store_mod.EXPORT_KIND and data["version"] == store_mod.EXPORT_VERSION
