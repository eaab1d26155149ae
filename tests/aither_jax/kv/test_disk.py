"""The disk tier's files: atomic, checksummed, fingerprinted, bounded; and a writer killed
with SIGKILL at random points never leaves a page that reads back wrong."""

from __future__ import annotations

import hashlib
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import aither_jax.kv.disk as disk_module
from aither_jax.kv.disk import LOCK, SUFFIX, DiskStore, DiskStoreError

PAGE_BYTES = 1 << 16


def payload(name: bytes) -> bytes:
    """A page's bytes, derived from its name so any reader can check a restore."""
    return hashlib.shake_256(name).digest(PAGE_BYTES)


def name(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def test_pages_survive_a_reopen_and_stay_within_the_capacity(tmp_path):
    store = DiskStore(tmp_path, fingerprint="f", page_bytes=PAGE_BYTES, capacity=3)
    for i in range(4):
        store.write(name(i), name(i - 1) if i else None, payload(name(i)), {"tag": "system", "hits": i})
    assert name(0) not in store and len(store) == 3 and store.counters.num_dropped == 1
    assert store.read(name(1)) == payload(name(1))  # now the most recently used
    again = DiskStore(tmp_path, fingerprint="f", page_bytes=PAGE_BYTES, capacity=3)
    assert len(again) == 3 and again.parent(name(2)) == name(1) and again.parent(name(3)) == name(2)
    assert again.meta(name(3)) == {"tag": "system", "hits": 3}  # the block metadata written with it
    assert all(again.read(name(i)) == payload(name(i)) for i in (1, 2, 3))
    with pytest.raises(ValueError, match="payload is 65536 bytes"):
        again.write(name(9), None, b"short")


def test_files_of_another_configuration_torn_or_corrupt_are_never_loaded(tmp_path):
    store = DiskStore(tmp_path, fingerprint="f", page_bytes=PAGE_BYTES, capacity=8)
    for i in range(4):
        store.write(name(i), None, payload(name(i)))
    files = {i: store.dir / (name(i).hex() + ".kvpage") for i in range(4)}
    raw = files[1].read_bytes()
    files[1].write_bytes(raw[: len(raw) // 2])  # short
    flipped = bytearray(files[2].read_bytes())
    flipped[-7] ^= 1  # one payload bit
    files[2].write_bytes(bytes(flipped))
    # Writes cut off: by a process no longer running, and one with no writer named, an hour old.
    dead, old = store.dir / f".tmp-{2**40}-abc.part", store.dir / ".tmpabc"
    live = store.dir / f".tmp-{os.getpid()}-def.part"  # another store's write under way: kept
    for path in (dead, old, live):
        path.write_bytes(b"cut off")
    os.utime(old, (time.time() - 2 * disk_module.TMP_MAX_AGE_S,) * 2)
    (store.dir / "junk.kvpage").write_bytes(b"\x00" * 40)
    reopened = DiskStore(tmp_path, fingerprint="f", page_bytes=PAGE_BYTES, capacity=8)
    assert reopened.counters.num_skipped == 2 and reopened.counters.num_torn == 2
    assert not dead.exists() and not old.exists() and live.exists()
    assert not files[1].exists() and (store.dir / "junk.kvpage").exists()  # its own damaged file goes, not others
    assert name(1) not in reopened and name(2) in reopened
    assert reopened.read(name(2)) is None and reopened.counters.num_corrupt == 1 and name(2) not in reopened
    assert reopened.read(name(3)) == payload(name(3))
    other = DiskStore(tmp_path, fingerprint="another model", page_bytes=PAGE_BYTES, capacity=8)
    assert len(other) == 0 and other.dir != reopened.dir  # another configuration's files: its own directory


def test_two_configurations_sharing_a_directory_keep_their_own_pages(tmp_path):
    a = DiskStore(tmp_path, fingerprint="model a", page_bytes=PAGE_BYTES, capacity=4)
    b = DiskStore(tmp_path, fingerprint="model b", page_bytes=PAGE_BYTES, capacity=4)
    a.write(name(0), None, payload(name(0)))
    b.write(name(0), None, payload(name(1)))  # one chain name (one salt, one prompt), two models
    assert a.read(name(0)) == payload(name(0)) and b.read(name(0)) == payload(name(1))


def test_files_of_the_flat_layout_are_removed_at_open(tmp_path):
    """Page files directly under pages/ (the layout before a directory per configuration) are
    read by no store: opening one removes them, and leaves every configuration's directory."""
    other = DiskStore(tmp_path, fingerprint="model b", page_bytes=PAGE_BYTES, capacity=4)
    other.write(name(1), None, payload(name(1)))
    flat = [tmp_path / "pages" / ("00" * 32 + SUFFIX), tmp_path / "pages" / f".tmp-{2**40}-x.part"]
    for path in flat:
        path.write_bytes(b"x" * 100)
    (tmp_path / "pages" / "notes.txt").write_text("not the store's")
    store = DiskStore(tmp_path, fingerprint="model a", page_bytes=PAGE_BYTES, capacity=4)
    assert not any(path.exists() for path in flat) and (tmp_path / "pages" / "notes.txt").exists()
    assert len(store) == 0 and other.read(name(1)) == payload(name(1))
    assert DiskStore(tmp_path, fingerprint="model b", page_bytes=PAGE_BYTES, capacity=4).read(name(1)) == payload(
        name(1)
    )


@pytest.mark.parametrize(
    ("change", "payload_unsure"),
    [
        (lambda h: h.replace(b'"sha256"', b'"sha2u6"'), True),  # no checksum
        (lambda h: h.replace(b'"fingerprint": "f"', b'"fingerprint": "g"'), True),  # another configuration's
        (lambda h: h.replace(b'"parent": null', b'"parent": "zz"'), False),  # not hex (the index has it right)
    ],
)
def test_a_malformed_header_is_skipped_at_open_and_a_miss_when_read(tmp_path, change, payload_unsure):
    store = DiskStore(tmp_path, fingerprint="f", page_bytes=PAGE_BYTES, capacity=4)
    store.write(name(0), None, payload(name(0)))
    path = store.dir / (name(0).hex() + ".kvpage")
    raw = path.read_bytes()
    n = int.from_bytes(raw[8:12], "little")
    header = change(raw[12 : 12 + n])
    assert len(header) == n  # the same length: only the header's content is wrong
    path.write_bytes(raw[:12] + header + raw[12 + n :])
    if payload_unsure:  # indexed before the header went bad: a counted miss
        assert store.read(name(0)) is None and store.counters.num_corrupt == 1
        store.write(name(0), None, payload(name(0)))
        path.write_bytes(raw[:12] + header + raw[12 + n :])
    reopened = DiskStore(tmp_path, fingerprint="f", page_bytes=PAGE_BYTES, capacity=4)
    assert name(0) not in reopened and reopened.counters.num_skipped == 1


def test_a_disk_that_refuses_deletes_leaves_the_store_working(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, fingerprint="f", page_bytes=PAGE_BYTES, capacity=1)
    store.write(name(0), None, payload(name(0)))

    def read_only(self, missing_ok=False):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(pathlib.Path, "unlink", read_only)
    store.write(name(1), None, payload(name(1)))  # drops page 0 to stay within capacity
    assert name(0) not in store and store.read(name(1)) == payload(name(1))
    assert store.counters.num_failed == 1


def test_bad_disk_settings_are_refused(tmp_path):
    with pytest.raises(DiskStoreError, match="at least one page"):
        DiskStore(tmp_path, fingerprint="f", page_bytes=8, capacity=0)
    os.chmod(tmp_path, 0o500)
    try:
        if os.access(tmp_path, os.W_OK):
            pytest.skip("running as a user who may write anywhere")
        with pytest.raises(DiskStoreError, match="cannot be created"):
            DiskStore(tmp_path / "sub", fingerprint="f", page_bytes=8, capacity=1)
    finally:
        os.chmod(tmp_path, 0o700)


def test_background_writes_are_readable_at_once_and_land_before_sync_returns(tmp_path):
    store = DiskStore(tmp_path, fingerprint="f", page_bytes=PAGE_BYTES, capacity=4, background=True)
    for i in range(6):
        store.write(name(i), None, payload(name(i)))
        assert store.read(name(i)) == payload(name(i))  # from memory or from its file
    store.drop(name(5))  # dropped before (or after) its write landed: no file either way
    store.sync()
    files = sorted(p.name for p in store.dir.iterdir() if p.name != LOCK)
    assert files == sorted(name(i).hex() + ".kvpage" for i in (2, 3, 4))
    assert store.counters.num_dropped == 2 and store.counters.num_failed == 0
    assert store.stage([name(2), name(3), name(9)]) == 2  # the unknown name is not read
    assert store.read(name(2)) == payload(name(2)) and store.read(name(3)) == payload(name(3))
    store.close()
    again = DiskStore(tmp_path, fingerprint="f", page_bytes=PAGE_BYTES, capacity=4)
    assert len(again) == 3 and all(again.read(name(i)) == payload(name(i)) for i in (2, 3, 4))


def test_a_staged_read_of_a_corrupt_file_is_a_counted_miss(tmp_path):
    store = DiskStore(tmp_path, fingerprint="f", page_bytes=PAGE_BYTES, capacity=4, background=True)
    store.write(name(0), None, payload(name(0)))
    store.sync()
    path = store.dir / (name(0).hex() + ".kvpage")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    assert store.stage([name(0)]) == 1
    assert store.read(name(0)) is None and store.counters.num_corrupt == 1 and not path.exists()
    store.close()


WRITER = """
import importlib.util, hashlib, sys
spec = importlib.util.spec_from_file_location("disk", sys.argv[1])
disk = sys.modules["disk"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(disk)
store = disk.DiskStore(sys.argv[2], fingerprint="f", page_bytes={page_bytes}, capacity=24)
start = int(sys.argv[3])
print("ready", flush=True)
for i in range(start, start + 10_000):
    name = hashlib.sha256(str(i).encode()).digest()
    store.write(name, None, hashlib.shake_256(name).digest({page_bytes}))
"""


def test_a_writer_killed_at_random_points_leaves_only_intact_pages(tmp_path):
    """200 writers, each killed with SIGKILL after a random delay while writing pages: every
    reopen indexes only pages whose bytes are exactly what was written."""
    rng = np.random.default_rng(0)
    code = WRITER.format(page_bytes=PAGE_BYTES)
    source = pathlib.Path(disk_module.__file__)
    wrong = restored = torn = 0
    for run in range(200):
        writer = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", code, str(source), str(tmp_path), str(run * 10_000)],
            stdout=subprocess.PIPE,
        )
        assert writer.stdout.readline() == b"ready\n"
        time.sleep(rng.uniform(0, 0.02))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        writer.stdout.close()
        store = DiskStore(tmp_path, fingerprint="f", page_bytes=PAGE_BYTES, capacity=24)
        torn += store.counters.num_torn
        for page in list(store._index):
            data = store.read(page)
            restored += data is not None
            wrong += data is not None and data != payload(page)
        assert store.counters.num_corrupt == 0 and store.counters.num_skipped == 0
    assert wrong == 0 and restored > 200 and torn > 0


def stored_bytes(root: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in (root / "pages").rglob("*" + SUFFIX))


def test_configurations_no_store_holds_open_give_way_first_within_the_size(tmp_path):
    old = DiskStore(tmp_path, fingerprint="old", page_bytes=PAGE_BYTES, capacity=4)
    for i in range(4):
        old.write(name(i), None, payload(name(i)))
        os.utime(old._path(name(i)), ns=(i * 10**9, i * 10**9))  # page 0 the oldest
    live = DiskStore(tmp_path, fingerprint="live", page_bytes=PAGE_BYTES, capacity=4)
    for i in range(10, 14):
        live.write(name(i), None, payload(name(i)))
    old.close()  # no store holds "old" open any more; "live" still does
    size = 4 * (PAGE_BYTES + 400)  # four pages and their headers
    new = DiskStore(tmp_path, fingerprint="new", page_bytes=PAGE_BYTES, capacity=4)
    assert len(new) == 0 and stored_bytes(tmp_path) >= 8 * PAGE_BYTES  # nothing goes before it is needed
    for i in range(20, 22):
        new.write(name(i), None, payload(name(i)))
    # The stale pages filled its size: two pages written, the two oldest of them went (three,
    # where the files' headers add up past a page), none of the live store's, none of its own.
    gone = [not old._path(name(i)).exists() for i in range(4)]
    assert gone in ([True, True, False, False], [True, True, True, False])
    assert new.counters.num_stale_removed == sum(gone) and new.counters.num_dropped == 0
    assert all(live._path(name(i)).exists() for i in range(10, 14)) and len(new) == 2
    for i in range(22, 26):  # then its own least recently used
        new.write(name(i), None, payload(name(i)))
    assert not old._path(name(3)).exists() and len(new) == 4 and new.counters.num_dropped == 2
    assert all(live._path(name(i)).exists() for i in range(10, 14))
    assert stored_bytes(tmp_path) - 4 * live._path(name(10)).stat().st_size <= size


def test_a_configuration_opened_again_is_live_and_kept(tmp_path):
    # A fleet opens its models' stores one after another: the second's directory looks stale to
    # the first until it opens, and it opens before the first writes.
    first = DiskStore(tmp_path, fingerprint="a", page_bytes=PAGE_BYTES, capacity=2)
    second = DiskStore(tmp_path, fingerprint="b", page_bytes=PAGE_BYTES, capacity=2)
    for i in range(2):
        second.write(name(i), None, payload(name(i)))
    second.close()
    first = DiskStore(tmp_path, fingerprint="a", page_bytes=PAGE_BYTES, capacity=2)  # "b" is stale now
    second = DiskStore(tmp_path, fingerprint="b", page_bytes=PAGE_BYTES, capacity=2)  # and live again
    assert len(second) == 2
    for i in range(10, 14):
        first.write(name(i), None, payload(name(i)))
    assert all(second.read(name(i)) == payload(name(i)) for i in range(2))
    assert first.counters.num_stale_removed == 0 and first.counters.num_dropped == 2


@pytest.mark.parametrize("background", [False, True])
def test_a_touched_page_keeps_its_place_across_a_restart(tmp_path, background):
    store = DiskStore(tmp_path, fingerprint="f", page_bytes=PAGE_BYTES, capacity=3, background=background)
    for i in range(3):
        store.write(name(i), None, payload(name(i)))
    store.sync()
    for i in range(3):
        os.utime(store._path(name(i)), ns=(i * 10**9, i * 10**9))  # page 0 the oldest file
    assert store.touch(name(0))  # a demotion of a page on disk already: now the most recent
    store.close()
    again = DiskStore(tmp_path, fingerprint="f", page_bytes=PAGE_BYTES, capacity=3)
    again.write(name(9), None, payload(name(9)))
    assert name(0) in again and name(1) not in again


def test_stores_of_one_process_keep_each_others_pages_where_locks_are_per_process(tmp_path, monkeypatch):
    # On NFS flock is emulated by POSIX locks, which a process holds once: another store of the
    # same process would get its exclusive lock. A model's store must still see the other's
    # directory as open.
    monkeypatch.setattr(disk_module.fcntl, "flock", lambda fd, op: None)  # every lock granted
    first = DiskStore(tmp_path, fingerprint="a", page_bytes=PAGE_BYTES, capacity=2)
    second = DiskStore(tmp_path, fingerprint="b", page_bytes=PAGE_BYTES, capacity=2)
    second.write(name(0), None, payload(name(0)))
    first.close()
    first = DiskStore(tmp_path, fingerprint="a", page_bytes=PAGE_BYTES, capacity=2)
    for i in range(10, 14):
        first.write(name(i), None, payload(name(i)))
    assert second.read(name(0)) == payload(name(0)) and first.counters.num_stale_removed == 0
    second.close()  # now stale to a store opened after
    third = DiskStore(tmp_path, fingerprint="c", page_bytes=PAGE_BYTES, capacity=2)
    for i in range(20, 24):
        third.write(name(i), None, payload(name(i)))
    assert not second._path(name(0)).exists()


def test_a_filesystem_without_locks_still_opens(tmp_path, monkeypatch, caplog):
    def refuse(fd, op):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(disk_module.fcntl, "flock", refuse)
    store = DiskStore(tmp_path, fingerprint="f", page_bytes=PAGE_BYTES, capacity=2)
    store.write(name(0), None, payload(name(0)))
    assert store.read(name(0)) == payload(name(0)) and "cannot lock" in caplog.text


def test_only_the_stores_own_files_are_ever_removed_as_stale(tmp_path):
    old = DiskStore(tmp_path, fingerprint="old", page_bytes=PAGE_BYTES, capacity=4)
    for i in range(2):
        old.write(name(i), None, payload(name(i)))
    old.close()
    keep = [old.dir / "README.txt", tmp_path / "pages" / "photos" / "holiday.jpg"]
    for path in keep:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"x" * PAGE_BYTES)
    new = DiskStore(tmp_path, fingerprint="new", page_bytes=PAGE_BYTES, capacity=2)
    for i in range(10, 12):
        new.write(name(i), None, payload(name(i)))
    assert new.counters.num_stale_removed == 2 and not any(old._path(name(i)).exists() for i in range(2))
    assert all(path.exists() for path in keep)


def test_a_filesystem_full_before_the_size_holds_what_fits(tmp_path, monkeypatch, caplog):
    store = DiskStore(tmp_path, fingerprint="f", page_bytes=PAGE_BYTES, capacity=100, background=True)
    mkstemp = disk_module.tempfile.mkstemp

    def room_for_three(*args, **kwargs):
        if len(list(store.dir.glob("*" + SUFFIX))) >= 3:
            raise OSError(28, "No space left on device")
        return mkstemp(*args, **kwargs)

    monkeypatch.setattr(disk_module.tempfile, "mkstemp", room_for_three)
    for i in range(8):
        store.write(name(i), None, payload(name(i)))
        store.sync()
    assert store.counters.num_failed == 1 and store.capacity == 3 and "filesystem is full" in caplog.text
    assert [store.read(name(i)) == payload(name(i)) for i in range(8)] == [False] * 5 + [True] * 3


def test_a_page_another_process_removed_is_missing_not_corrupt(tmp_path):
    store = DiskStore(tmp_path, fingerprint="f", page_bytes=PAGE_BYTES, capacity=4)
    store.write(name(0), None, payload(name(0)))
    store._path(name(0)).unlink()
    assert store.read(name(0)) is None and name(0) not in store
    assert store.counters.num_missing == 1 and store.counters.num_corrupt == 0
