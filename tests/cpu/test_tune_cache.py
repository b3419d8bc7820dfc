"""The tuning cache: keys, persistence, concurrent writers, and recovery from bad files.

- Keys: kernels equal up to names (values, loop variables, buffers, the kernel) share a key;
  a different shape, dtype, device, capability, toolkit or family version is another key.
- Entries round-trip (knobs, stats, failures) and survive reopening from another process.
- Four processes writing at once, to distinct keys and to one shared key, lose nothing and
  raise nothing.
- A file of garbage, a truncated database, a foreign SQLite file and an older schema are
  each detected, moved aside with a RuntimeWarning, and replaced by a working cache.
"""
from __future__ import annotations

import sqlite3
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import loop_fixtures as fx  # noqa: E402

from tilefuse.loop.canon import canonicalize  # noqa: E402
from tilefuse.tune import cache as tc  # noqa: E402
from tilefuse.tune.device import Device  # noqa: E402
from tilefuse.tune.families import get_family  # noqa: E402

H100 = Device("NVIDIA H100 80GB HBM3", "9.0", "13.0")
MR = get_family("mapreduce")


def key(kernel, device=H100, family=MR):
    return tc.key_for(kernel, device, family)


def entry(k, n=0):
    return tc.Entry(k, {"threads": 128 + n, "stage": "smem"}, {"median_us": 10.0 + n},
                    ({"knobs": {"threads": 64}, "reason": "timed out"},))


# ---------------------------------------------------------------- keys

def test_kernels_equal_up_to_names_share_a_key():
    k = fx.rmsnorm_kernel(64, 1024, "bf16")
    renamed = canonicalize(k, rename_buffers=True)
    renamed = replace(renamed, name="something_else")
    assert renamed != k and [b.name for b in renamed.params] != [b.name for b in k.params]
    assert key(renamed) == key(k) and key(renamed).digest == key(k).digest


@pytest.mark.parametrize("other", [
    fx.rmsnorm_kernel(64, 2048, "bf16"), fx.rmsnorm_kernel(128, 1024, "bf16"),
    fx.rmsnorm_kernel(64, 1024, "f16"), fx.rmsnorm_kernel(64, 1024, "f32"), fx.softmax_kernel(64, 1024, "bf16"),
], ids=["cols", "rows", "f16", "f32", "other-kernel"])
def test_a_different_shape_dtype_or_kernel_is_another_key(other):
    assert key(other).digest != key(fx.rmsnorm_kernel(64, 1024, "bf16")).digest


@pytest.mark.parametrize("device", [
    Device("NVIDIA H200", "9.0", "13.0"), Device("NVIDIA H100 80GB HBM3", "8.0", "13.0"),
    Device("NVIDIA H100 80GB HBM3", "9.0", "13.1"),
], ids=["name", "capability", "toolkit"])
def test_a_different_device_or_toolkit_is_another_key(device):
    k = fx.rmsnorm_kernel(64, 1024, "bf16")
    assert key(k, device).digest != key(k).digest


def test_a_new_family_version_is_another_key():
    k = fx.rmsnorm_kernel(64, 1024, "bf16")
    assert key(k, family=replace(MR, version=MR.version + ".next")).digest != key(k).digest


# ---------------------------------------------------------------- storing

def test_entries_round_trip_and_persist(tmp_path):
    path = tmp_path / "tune.sqlite"
    k = key(fx.softmax_kernel(8, 256, "bf16"))
    c = tc.TuneCache(path)
    assert c.get(k) is None
    e = entry(k)
    c.put(e)
    got = tc.TuneCache(path).get(k)
    assert got.knobs == e.knobs and got.stats == e.stats and got.failures == e.failures and got.created > 0
    with sqlite3.connect(path) as con:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    c.put(replace(e, knobs={"threads": 512}))
    assert c.get(k).knobs == {"threads": 512} and len(c.entries()) == 1


def test_default_path_follows_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path))
    assert tc.default_path() == tmp_path / "tune.sqlite"
    monkeypatch.delenv("TILEFUSE_CACHE_DIR")
    assert tc.default_path() == Path.home() / ".cache" / "tilefuse" / "tune.sqlite"


WRITER = """
import sys
from tilefuse.tune import cache as tc
path, worker, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = tc.TuneCache(path)
for i in range(n):
    k = tc.Key("dev", "9.0", "13.0", "mapreduce", "1", f"hash-{worker}-{i}", "sig")
    c.put(tc.Entry(k, {"i": i, "worker": worker}, {"median_us": float(i)}))
    c.put(tc.Entry(tc.Key("dev", "9.0", "13.0", "mapreduce", "1", "shared", "sig"), {"worker": worker, "i": i}, {}))
    assert c.get(k).knobs == {"i": i, "worker": worker}
"""


def test_concurrent_writers_from_several_processes_lose_nothing(tmp_path):
    path = tmp_path / "tune.sqlite"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(w), "30"], stderr=subprocess.PIPE)
             for w in range(4)]
    errs = [p.communicate(timeout=60)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], errs
    assert not any("Warning" in e for e in errs), errs
    got = {(e.knobs["worker"], e.knobs["i"]) for e in tc.TuneCache(path).entries() if e.key.khash != "shared"}
    assert got == {(w, i) for w in range(4) for i in range(30)}
    shared = [e for e in tc.TuneCache(path).entries() if e.key.khash == "shared"]
    assert len(shared) == 1 and shared[0].knobs["i"] == 29  # some writer's last write


# ---------------------------------------------------------------- recovery

def _garbage(path):
    path.write_bytes(b"this is not a database at all\n" * 200)


def _truncated(path):
    c = tc.TuneCache(path)
    for i in range(40):
        c.put(entry(tc.Key("d", "9.0", "13.0", "mapreduce", "1", f"h{i}", "s" * 1000), i))
    with sqlite3.connect(path) as con:
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2] + b"\x00" * 4096 + data[len(data) // 2 + 4096:])


def _foreign(path):
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE photos (id INTEGER)")


def _old_schema(path):
    tc.TuneCache(path).put(entry(tc.Key("d", "9.0", "13.0", "mapreduce", "1", "h", "s")))
    with sqlite3.connect(path) as con:
        con.execute("UPDATE meta SET value='0' WHERE name='schema'")


@pytest.mark.parametrize("spoil", [_garbage, _truncated, _foreign, _old_schema],
                         ids=["garbage", "truncated", "foreign", "old-schema"])
def test_a_bad_file_is_rebuilt_with_a_warning_never_a_crash(tmp_path, spoil):
    path = tmp_path / "tune.sqlite"
    spoil(path)
    tc._checked.clear()  # as a fresh process would
    k = key(fx.softmax_kernel(8, 256, "bf16"))
    with pytest.warns(RuntimeWarning, match="tuning cache"):
        c = tc.TuneCache(path)
        assert c.get(k) is None
    c.put(entry(k))
    assert c.get(k).knobs == entry(k).knobs
    assert (tmp_path / "tune.sqlite.bad").exists()


def test_corruption_found_after_opening_is_recovered_too(tmp_path):
    path = tmp_path / "tune.sqlite"
    c = tc.TuneCache(path)
    k = key(fx.softmax_kernel(8, 256, "bf16"))
    c.put(entry(k))
    for suffix in ("", "-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    _garbage(path)  # replaced under a process that already checked it
    with pytest.warns(RuntimeWarning, match="tuning cache"):
        assert c.get(k) is None
    c.put(entry(k, 3))
    assert c.get(k).knobs["threads"] == 131


def test_state_moves_with_this_process_writes_and_the_switch_not_with_reads(tmp_path, monkeypatch):
    """runtime.program keeps compiled kernels while `state()` stays: a put or delete here, or
    TILEFUSE_TUNED, must move it; a lookup (which creates the file and SQLite's WAL) must not."""
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path))
    c, k = tc.TuneCache(), key(fx.rmsnorm_kernel(64, 1024, "bf16"))
    before = tc.state()
    assert c.get(k) is None and tc.state() == before
    c.put(entry(k))
    after_put = tc.state()
    assert after_put != before and c.get(k) is not None and tc.state() == after_put
    c.delete(k)
    assert tc.state() != after_put
    now = tc.state()
    monkeypatch.setenv("TILEFUSE_TUNED", "0")
    assert tc.state() != now
