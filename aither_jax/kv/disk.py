"""The disk tier: KV pages as files that survive a crash and a restart.

One file per page, named by the page's chain name (prefix_cache.page_hash, already salted per
tenant), holding the page's stored bytes exactly as the device pools keep them (TurboQuant
codes and norms included). A file is written to a temporary name, flushed, fsynced and renamed
into place, so a reader sees either the whole file or none. Each file carries:

    MAGIC (8 bytes) | header length (4 bytes, little endian) | header (JSON) | payload

The header holds the store's fingerprint (everything that makes the bytes meaningful: model
file, tokenizer, KV format and codec, page size, code version; see `PageStore.fingerprint`),
the page's name and parent, what its block record knew (tag, importance, token range, hits),
the payload's length and its SHA-256. Each configuration keeps its files in a directory of
its own (`pages/<fingerprint>/`), so stores of two models sharing a root never write the same
file. An open store holds a shared lock on its directory (`.lock`, flock); the files of the
other configurations' directories that no store holds open are stale, and count against the
store's size limit before its own pages: the oldest go first, each directory's under an
exclusive lock taken without waiting (one a process opens meanwhile is live again and kept),
so a root used by several configurations over time stays within the size it is given
(stale files go only as writes need room). Opening a directory indexes the files whose header
matches; one torn (short), unreadable or with a malformed header is skipped and counted, never
loaded. A payload whose checksum (or
header) fails when read is deleted and counted as corrupt, and the lookup is a miss: the page
is recomputed. A file that cannot be deleted (a read-only disk) is logged and left; the store
goes on.

With `background=True` files are written and read on one I/O thread, off the caller's path:
a write is in the index (and readable, from memory) at once and reaches its file later; `stage`
starts reading pages expected soon; `sync` waits until every write is on disk. A file is only
renamed into place while its page is still indexed, so a page dropped before its write landed
leaves nothing behind.

This module needs only numpy and the standard library, so a separate writer process can use it
without loading JAX.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import re
import shutil
import struct
import tempfile
import threading
import time

log = logging.getLogger(__name__)

MAGIC = b"AJKVPG1\n"
SUFFIX = ".kvpage"
LOCK = ".lock"  # held shared by each open store of a directory's configuration
TMP = ".tmp"  # a write before its rename: `.tmp-<writer's pid>-<random>.part`
TMP_MAX_AGE_S = 3600.0  # a temporary file this old is a dead write whatever its name says
# What the store names: a configuration's directory (16 hex digits of its fingerprint's hash)
# and a page file (its name's 32 bytes in hex). Nothing else under `pages/` is ever removed.
_CONFIG_DIR = re.compile(r"[0-9a-f]{16}")
_PAGE_FILE = re.compile(r"[0-9a-f]{64}" + re.escape(SUFFIX))
_LEN = struct.Struct("<I")
MAX_HEADER = 1 << 16


class DiskStoreError(ValueError):
    """A disk tier that cannot be used as configured (a directory that is not writable, ...)."""


@dataclasses.dataclass
class DiskCounters:
    """What the disk tier did (pages unless named otherwise)."""

    num_written: int = 0
    num_read: int = 0
    num_dropped: int = 0  # evicted to stay within the size limit
    num_torn: int = 0  # temporary files at open: writes cut off before their rename
    num_skipped: int = 0  # files at open that were unreadable, short or of another configuration
    num_corrupt: int = 0  # payloads whose checksum failed when read
    num_failed: int = 0  # background writes that failed (a full disk): the page was dropped
    num_stale_removed: int = 0  # files of configurations no store held open, removed to stay within the size
    num_missing: int = 0  # indexed pages whose file was gone when read (removed by another process)
    bytes_written: int = 0
    bytes_read: int = 0


class DiskStore:
    """Pages on disk under `directory/pages/<fingerprint>/`, at most `capacity` of them (least
    recently used dropped first). `fingerprint` names the configuration the bytes belong to;
    `page_bytes` is every page's payload length."""

    MAX_STAGED = 256  # reads started ahead and not yet taken

    def __init__(
        self, directory: str | os.PathLike, *, fingerprint: str, page_bytes: int, capacity: int, background=False
    ):
        if capacity < 1:
            raise DiskStoreError(f"the disk tier must hold at least one page ({page_bytes} bytes), got {capacity}")
        self.root = pathlib.Path(directory)
        self.dir = self.root / "pages" / hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DiskStoreError(f"KV cache directory {str(self.root)!r} cannot be created: {e.strerror}") from None
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise DiskStoreError(f"KV cache directory {str(self.root)!r} is not writable")
        try:
            self._lock_fd = os.open(self.dir / LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        except OSError as e:
            raise DiskStoreError(f"KV cache directory {str(self.root)!r} cannot be locked: {e.strerror}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_SH)  # waits while another store clears it as stale
        except OSError as e:  # a filesystem without locks: this process's stores still know it is open
            log.warning("KV disk tier %s: cannot lock (%s); other processes may take its files for stale", self.dir, e)
        with _OPEN_LOCK:
            key = os.path.realpath(self.dir)
            _OPEN[key] = _OPEN.get(key, 0) + 1
        self.fingerprint = fingerprint
        self.page_bytes = page_bytes
        self.capacity = capacity
        self.counters = DiskCounters()
        # name -> parent name (None for a chain's first page), least recently used first.
        self._index: collections.OrderedDict[bytes, bytes | None] = collections.OrderedDict()
        self._meta: dict[bytes, dict] = {}  # name -> block metadata, where a page has any
        self._lock = threading.RLock()  # the index and `_pending`, shared with the I/O thread
        self._pending: dict[bytes, bytes] = {}  # name -> payload whose write has not landed yet
        self._staged: collections.OrderedDict[bytes, concurrent.futures.Future] = collections.OrderedDict()
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-disk") if background else None
        # Files of other configurations' directories, oldest first: (directory, path, bytes).
        self._stale: collections.deque[tuple[pathlib.Path, pathlib.Path, int]] = collections.deque()
        self._stale_bytes = 0
        # Names of pages it dropped (to stay within its size, corrupt, a failed write), for the
        # tiers to tell the eviction advisor (`KVTiers.take_lost`); appended from any thread.
        self.lost: collections.deque[bytes] = collections.deque()
        self._open()

    # -- index --------------------------------------------------------------------------------

    def _open(self) -> None:
        """Indexes the intact files of this configuration, oldest first; removes its page files
        that are not (torn, damaged), the temporary files of writes no process will finish, and
        the files of the flat layout before per-configuration directories, which no store
        reads."""
        self._remove_flat_layout()
        found = []
        for path in self.dir.iterdir():
            if path.name.startswith(TMP):
                if _dead_write(path):  # a write that never reached its rename (another's may be under way)
                    _remove(path)
                    self.counters.num_torn += 1
                continue
            if path.suffix != SUFFIX:
                continue
            header = self._read_header(path)
            if header is None:
                self.counters.num_skipped += 1
                if _PAGE_FILE.fullmatch(path.name):  # one of its own, cut short or damaged: no use to anyone
                    _remove(path)
                continue
            found.append((path.stat().st_mtime_ns, header))
        for _, header in sorted(found, key=lambda f: f[0]):
            name, parent = header["name"], header["parent"]
            self._index[name] = parent
            if isinstance(header.get("meta"), dict):
                self._meta[name] = header["meta"]
        if self.counters.num_skipped:
            log.warning(
                "KV disk tier %s: skipped %d unreadable or foreign page files", self.dir, self.counters.num_skipped
            )
        self._find_stale()
        # Stale files go only as writes need room: the other stores of this process (the
        # other models of a fleet) open their directories after this one, before any write.
        self._fit(self.capacity, stale=False)
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(self.dir).free + (len(self._index) * self.page_bytes + self._stale_bytes)
            if free < self.capacity * self.page_bytes:
                log.warning(
                    "KV disk tier %s: its size is %.2f GiB but the filesystem has room for %.2f GiB; it holds what "
                    "fits", self.dir, self.capacity * self.page_bytes / (1 << 30), free / (1 << 30),
                )  # fmt: skip

    def _find_stale(self) -> None:
        """Lists the files of the other configurations' directories that no store holds open,
        oldest first (asked again when its files are to go: one may be opened meanwhile)."""
        found = []
        for directory in self.dir.parent.iterdir():
            if directory == self.dir or not _CONFIG_DIR.fullmatch(directory.name) or not directory.is_dir():
                continue
            with _exclusive(directory) as free:
                if not free:
                    continue
            with contextlib.suppress(OSError), os.scandir(directory) as entries:
                for entry in entries:  # the store's files only: page files and its writes' temporaries
                    ours = _PAGE_FILE.fullmatch(entry.name) or entry.name.startswith(TMP)
                    if ours and entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        found.append((st.st_mtime_ns, directory, pathlib.Path(entry.path), st.st_size))
        found.sort(key=lambda f: f[0])
        self._stale = collections.deque((d, p, n) for _, d, p, n in found)
        self._stale_bytes = sum(n for _, _, n in self._stale)

    def _drop_stale(self, num_bytes: int) -> None:
        """Takes the oldest stale files off the list until `num_bytes` are freed or none is
        left, and removes them (on the I/O thread in the background), a directory at a time
        under its exclusive lock; a directory a store holds open is live, and its files stay."""
        batch: dict[pathlib.Path, list[pathlib.Path]] = {}
        while num_bytes > 0 and self._stale:
            directory, path, size = self._stale.popleft()
            self._stale_bytes -= size
            batch.setdefault(directory, []).append(path)
            num_bytes -= size
        if not batch:
            return
        if not self.counters.num_stale_removed:
            log.info(
                "KV disk tier %s: removing page files of configurations no store has open (oldest first) to stay "
                "within %d pages", self.dir.parent, self.capacity,
            )  # fmt: skip
        if self._io is not None:
            self._io.submit(self._remove_stale, batch)
        else:
            self._remove_stale(batch)

    def _remove_stale(self, batch: dict[pathlib.Path, list[pathlib.Path]]) -> None:
        live = []
        for directory, paths in batch.items():
            with _exclusive(directory) as free:
                if not free:
                    live.append(directory)
                    continue
                removed = sum(_remove(path) for path in paths)
            with self._lock:
                self.counters.num_stale_removed += removed
        if live:  # opened meanwhile: none of its files is stale any more
            with self._lock:
                kept = [f for f in self._stale if f[0] not in live]
                self._stale, self._stale_bytes = collections.deque(kept), sum(n for _, _, n in kept)

    def _remove_flat_layout(self) -> None:
        flat = [
            p
            for p in self.dir.parent.iterdir()
            if p.is_file() and (_PAGE_FILE.fullmatch(p.name) or (p.name.startswith(TMP) and _dead_write(p)))
        ]
        removed = sum(_remove(path) for path in flat)
        if removed:
            log.info("KV disk tier %s: removed %d page files of the flat layout", self.dir.parent, removed)

    def _read_header(self, path: pathlib.Path) -> dict | None:
        """The header of an intact file of this configuration, its name and parent as bytes;
        None for any other file (torn, foreign, malformed)."""
        read = self._read(path, payload=False)
        if read is None:
            return None
        header, parent = read[0], read[0].get("parent")
        if parent is not None and not _hex(parent):
            return None
        return header | {
            "name": bytes.fromhex(header["name"]),
            "parent": None if parent is None else bytes.fromhex(parent),
        }

    def _read(self, path: pathlib.Path, *, payload: bool) -> tuple[dict, bytes | None] | None:
        """(header, payload if asked for) of a file of this configuration whose header is well
        formed, whose length is the header's and the payload's, and (with `payload`) whose
        payload passes its checksum; None otherwise."""
        try:
            with open(path, "rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    return None
                (n,) = _LEN.unpack(f.read(_LEN.size))
                if n > MAX_HEADER:
                    return None
                header = json.loads(f.read(n))
                body = f.read() if payload else None
                size = os.fstat(f.fileno()).st_size
        except (OSError, ValueError, struct.error):
            return None
        if not isinstance(header, dict) or header.get("fingerprint") != self.fingerprint:
            return None
        if header.get("payload") != self.page_bytes or size != len(MAGIC) + _LEN.size + n + self.page_bytes:
            return None  # torn, or a page of another layout
        name, digest = header.get("name"), header.get("sha256")
        if not isinstance(name, str) or path.name != name + SUFFIX or not _hex(name) or not _hex(digest, 32):
            return None
        if payload and hashlib.sha256(body).hexdigest() != digest:
            return None
        return header, body

    def _path(self, name: bytes) -> pathlib.Path:
        return self.dir / (name.hex() + SUFFIX)

    def __contains__(self, name: bytes) -> bool:
        return name in self._index

    def __len__(self) -> int:
        return len(self._index)

    def parent(self, name: bytes) -> bytes | None:
        """The page's parent name (None for a chain's first page, or a page no longer held)."""
        with self._lock:
            return self._index.get(name)

    def meta(self, name: bytes) -> dict | None:
        """The block metadata written with a page (None without any)."""
        return self._meta.get(name)

    # -- pages --------------------------------------------------------------------------------

    def write(self, name: bytes, parent: bytes | None, payload: bytes | memoryview, meta: dict | None = None) -> None:
        """Stores a page atomically (it is the most recently used afterwards), with its block
        metadata `meta`; in the background with `background=True`."""
        if len(payload) != self.page_bytes:
            raise ValueError(f"a page payload is {self.page_bytes} bytes, got {len(payload)}")
        with self._lock:
            if self.touch(name, meta):
                return
            self._fit(self.capacity - 1)
            self._index[name] = parent
            if meta:
                self._meta[name] = meta
            self.counters.num_written += 1
            self.counters.bytes_written += len(payload)
            if self._io is None:
                self._write_file(name, parent, payload, meta)
                return
            payload = bytes(payload)
            self._pending[name] = payload
        self._io.submit(self._write_file, name, parent, payload, meta)

    def touch(self, name: bytes, meta: dict | None = None) -> bool:
        """Makes a held page the most recently used, with its newer block metadata `meta` (its
        file keeps what it was written with, and takes the time, so the order survives a
        restart); returns whether the page is held."""
        with self._lock:
            if name not in self._index:
                return False
            self._index.move_to_end(name)
            if meta:
                self._meta[name] = meta
            if self._io is not None:
                self._io.submit(_touch_file, self._path(name))
            else:
                _touch_file(self._path(name))
            return True

    def _write_file(self, name: bytes, parent: bytes | None, payload: bytes, meta: dict | None = None) -> None:
        """Writes a temporary file, fsyncs it, and renames it into place if the page is still
        indexed (and, in the background, this write is still the page's latest)."""
        header = json.dumps(
            {
                "fingerprint": self.fingerprint,
                "name": name.hex(),
                "parent": None if parent is None else parent.hex(),
                "payload": len(payload),
                "sha256": hashlib.sha256(payload).hexdigest(),
                **({"meta": meta} if meta else {}),
            }
        ).encode()
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=f"{TMP}-{os.getpid()}-", suffix=".part", dir=self.dir)
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + _LEN.pack(len(header)) + header)
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            with self._lock:
                current = self._io is None or self._pending.get(name) is payload
                if current and name in self._index:
                    os.replace(tmp, self._path(name))
                    tmp = None
                if current:
                    self._pending.pop(name, None)
        except Exception as e:  # noqa: BLE001 - in the background the page is dropped, not the thread
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                self._shrink(name)
            if self._io is None:
                with self._lock:
                    self._index.pop(name, None)
                    self._meta.pop(name, None)
                raise
            log.warning("KV disk tier: writing %s failed (%s); the page is dropped", name.hex(), e)
            with self._lock:
                if self._pending.get(name) is payload:
                    self._pending.pop(name)
                    self._index.pop(name, None)
                    self._meta.pop(name, None)
                    self.lost.append(name)
                self.counters.num_failed += 1
        finally:
            if tmp is not None:
                pathlib.Path(tmp).unlink(missing_ok=True)

    def _shrink(self, failed: bytes) -> None:
        """The filesystem is full before the store's size: it holds the pages it has from now on
        (the next write makes room by dropping the least recently used)."""
        with self._lock:
            held = max(1, len(self._index) - (failed in self._index))
            if held < self.capacity:
                log.warning(
                    "KV disk tier %s: the filesystem is full at %d pages; holding at most that many from now on",
                    self.dir, held,
                )  # fmt: skip
                self.capacity = held

    def sync(self) -> None:
        """Returns once every write made so far is on disk, its directory entry included."""
        if self._io is not None:
            self._io.submit(self._sync_dir).result()
        else:
            self._sync_dir()

    def _sync_dir(self) -> None:
        try:
            fd = os.open(self.dir, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)  # the renames and unlinks so far survive a power cut
        except OSError as e:
            log.warning("KV disk tier: syncing %s failed (%s)", self.dir, e)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Finishes the pending writes, stops the I/O thread and lets go of the directory."""
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        self._unlock()

    def _unlock(self) -> None:
        fd, self._lock_fd = getattr(self, "_lock_fd", None), None
        if fd is not None:
            os.close(fd)  # releases the lock
            with _OPEN_LOCK:
                key = os.path.realpath(self.dir)
                _OPEN[key] -= 1
                if not _OPEN[key]:
                    del _OPEN[key]

    def __del__(self):
        try:
            self._unlock()
        except Exception:  # noqa: BLE001 - at interpreter exit the module's globals may be gone
            pass

    def stage(self, names) -> int:
        """Starts reading these indexed pages on the I/O thread (background stores only), so a
        `read` soon after finds them in memory; returns how many reads were started."""
        if self._io is None:
            return 0
        started = 0
        with self._lock:
            for name in names:
                if name in self._staged or name in self._pending or name not in self._index:
                    continue
                self._staged[name] = self._io.submit(self._load, self._path(name))
                started += 1
            while len(self._staged) > self.MAX_STAGED:
                self._staged.popitem(last=False)[1].cancel()
        return started

    def _load(self, path: pathlib.Path) -> bytes | None:
        """The payload of a page file if its header is this configuration's and the payload
        passes its checksum, else None."""
        read = self._read(path, payload=True)
        if read is None:
            return None
        _touch_file(path)  # read: the most recently used at the next open too
        return read[1]

    def read(self, name: bytes) -> bytes | None:
        """A page's payload, or None when its file is gone or fails its checksum (it is then
        dropped and counted as corrupt)."""
        with self._lock:
            if name not in self._index:
                self._staged.pop(name, None)
                return None
            payload = self._pending.get(name)
            staged = self._staged.pop(name, None)
        if payload is None:
            payload = staged.result() if staged is not None and not staged.cancelled() else None
            if payload is None:
                payload = self._load(self._path(name))
        with self._lock:
            if payload is None:
                if self._path(name).exists():
                    self.counters.num_corrupt += 1
                    log.warning("KV disk tier: %s failed its checksum; dropped (the page is recomputed)", name.hex())
                else:  # another process sharing the directory removed it (its own size, or as stale)
                    self.counters.num_missing += 1
                self.drop(name)
                return None
            if name in self._index:
                self._index.move_to_end(name)
            self.counters.num_read += 1
            self.counters.bytes_read += len(payload)
        return payload

    def drop(self, name: bytes) -> None:
        with self._lock:
            if name in self._index:
                self.lost.append(name)
            self._index.pop(name, None)
            self._meta.pop(name, None)
            self._pending.pop(name, None)
            self._staged.pop(name, None)
            if not _remove(self._path(name)):  # a read-only or failing disk: gone from the index all the same
                self.counters.num_failed += 1

    def _fit(self, limit: int, *, stale: bool = True) -> None:
        """Drops stale files (with `stale`), oldest first, then the least recently used
        pages, until the stale files and the pages take at most `limit` pages' bytes."""
        limit = max(limit, 0)
        over = len(self._index) * self.page_bytes + self._stale_bytes - limit * self.page_bytes
        if stale and over > 0 and self._stale:
            self._drop_stale(over)
        while len(self._index) > limit:
            name = next(iter(self._index))
            self.drop(name)
            self.counters.num_dropped += 1


def _dead_write(path: pathlib.Path) -> bool:
    """Whether a temporary file is a write no process will finish: its writer (named in it) is
    not running, or it is older than TMP_MAX_AGE_S (also the rule for unnamed ones)."""
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:
        return False
    if age > TMP_MAX_AGE_S:
        return True
    pid = path.name[len(TMP) :].split("-")
    if len(pid) < 3 or pid[0] or not pid[1].isdigit():
        return False
    try:
        os.kill(int(pid[1]), 0)  # PermissionError: another user's process, running
    except (ProcessLookupError, OverflowError):  # no such process (or no such pid)
        return True
    except OSError:
        pass
    return False


def _touch_file(path: pathlib.Path) -> None:
    """Sets a file's time to now (its place in the least recently used order at the next
    open); a file not written yet, or a disk that refuses, is left as it is."""
    with contextlib.suppress(OSError):
        os.utime(path)


# The directories this process's stores hold open, with how many hold each: where locks are
# per process (flock emulated by POSIX locks, on NFS) a store could otherwise lock another's
# directory of the same process, and closing that lock file would drop the other's lock.
_OPEN: dict[str, int] = {}  # by real path
_OPEN_LOCK = threading.Lock()


@contextlib.contextmanager
def _exclusive(directory: pathlib.Path):
    """Yields whether an exclusive lock on `directory` was had without waiting (no store
    holds it open); held until the block ends."""
    with _OPEN_LOCK:
        mine = os.path.realpath(directory) in _OPEN
    if mine:
        yield False
        return
    try:
        fd = os.open(directory / LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    except OSError:
        yield False  # cannot be locked (read-only): left alone
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _remove(path: pathlib.Path) -> bool:
    """Deletes a file (one already gone counts as deleted); False, logged, where the disk
    refuses (read-only, failing)."""
    try:
        path.unlink(missing_ok=True)
        return True
    except OSError as e:
        log.warning("KV disk tier: cannot remove %s (%s)", path, e)
        return False


def _hex(value, num_bytes: int | None = None) -> bool:
    """Whether `value` is the hex text of some bytes (`num_bytes` of them when given)."""
    if not isinstance(value, str) or not value or (num_bytes is not None and len(value) != 2 * num_bytes):
        return False
    try:
        bytes.fromhex(value)
    except ValueError:
        return False
    return True


SECRET_FILE = "tenant_secret"


def tenant_secret(directory: str | os.PathLike) -> bytes:
    """The 32-byte secret that salts tenants' chain names, kept in `directory` (owner-only
    permissions) so names, and so tenants' disk pages, stay the same across restarts. Made on
    first use; raises DiskStoreError if the directory cannot hold it."""
    root = pathlib.Path(directory)
    path = root / SECRET_FILE
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            fd, tmp = tempfile.mkstemp(prefix=".tmp", dir=root)  # mkstemp files are owner-only
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(32))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # never replaces a secret another process made meanwhile
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        secret = path.read_bytes()
    except OSError as e:
        raise DiskStoreError(f"KV cache directory {str(root)!r} cannot hold the tenant secret: {e}") from None
    if len(secret) != 32:
        raise DiskStoreError(f"{path} is not a tenant secret (32 bytes); remove it to make a new one")
    return secret
