"""POSIX shared-memory segments holding the host parts of one publication.

A segment is created per conversion batch (sized to the batch's large host parts), filled with
one copy per part, described to the daemon by name/offset/length, and unlinked once the
publication's report arrived (the daemon maps segments while the publication is open and reads
them at commit, so their contents must not change before then). Segments are files under
/dev/shm, which is what shm_open(3) uses on Linux; going through the file system directly
avoids multiprocessing's resource tracker (an extra process that unlinks "leaked" segments)."""

import bisect
import mmap
import os
import secrets
from typing import Dict, List, Optional, Tuple

import numpy as np

_SHM_DIR = "/dev/shm"
_ALIGN = 64  # part offsets are 64-byte aligned so the daemon reads aligned rows


def align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class ShmSegment:
    """One writable segment. Not thread-safe; owned by one publication."""

    def __init__(self, name: str, size: int):
        if "/" in name:
            raise ValueError(f"shared-memory name '{name}' must not contain '/'")
        self.name = "/" + name  # the daemon's (shm_open) spelling
        self.path = os.path.join(_SHM_DIR, name)
        self.size = max(size, 1)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self.size)
            self._map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self._view = np.frombuffer(self._map, dtype=np.uint8)

    @property
    def address(self) -> int:
        """Where the segment is mapped in this process."""
        return self._view.ctypes.data

    def array(self, shape, dtype) -> np.ndarray:
        """A numpy array over the whole segment's first bytes (shares its memory)."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(self._map, dtype=dtype, count=count).reshape(shape)

    def write(self, offset: int, array: np.ndarray) -> None:
        """Copies `array`'s bytes (C-contiguous) to `offset`."""
        n = array.nbytes
        if n:
            self._view[offset:offset + n] = array.reshape(-1).view(np.uint8)

    def close(self) -> None:
        """Unmaps and unlinks (idempotent). Mappings the daemon holds stay valid."""
        if self._map is None:
            return
        self._view = None
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still referenced somewhere; the mapping dies with it
        self._map = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class ShmPool:
    """The shared-memory segments of one Publisher. A publication acquires one segment per
    batch (its slot); when the publication ended with a report, release(reuse=True) keeps them
    for the next publication, whose batch b usually needs the same size again (same model every
    step). Reusing pages that are already faulted in is several times faster than filling fresh
    ones, at the price of keeping one model's worth of shm between publications; segments of a
    publication that was cancelled or failed without a report are unlinked instead.

    Names are "/<prefix>-<pid>-<random>-<n>", so close() and a later process can tell whose
    they are; a segment left behind by a process that died is unlinked by the next pool created
    with the same prefix. Not thread-safe: used by one publish() at a time."""

    def __init__(self, prefix: str):
        self._prefix = prefix
        self._base = f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
        self._count = 0
        self._free: Dict[int, ShmSegment] = {}
        self._closed = False
        self._remove_orphans()

    def _remove_orphans(self) -> None:
        head = f"{self._prefix}-"
        try:
            names = os.listdir(_SHM_DIR)
        except OSError:
            return
        for name in names:
            if not name.startswith(head):
                continue
            pid = name[len(head):].split("-", 1)[0]
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                try:
                    os.unlink(os.path.join(_SHM_DIR, name))
                except OSError:
                    pass
            except PermissionError:
                pass  # alive, another user's

    def acquire(self, slot: int, size: int) -> ShmSegment:
        """A segment of at least `size` bytes for batch `slot` (reused when one is free)."""
        seg = self._free.pop(slot, None)
        if seg is not None:
            if seg.size >= size:
                return seg
            seg.close()
        self._count += 1
        return ShmSegment(f"{self._base}-{self._count}", size)

    def release(self, segments: Dict[int, ShmSegment], reuse: bool) -> None:
        reuse = reuse and not self._closed  # a publication that outlived close()
        for slot, seg in segments.items():
            old = self._free.pop(slot, None) if reuse else None
            if old is not None and old is not seg:
                old.close()
            if reuse:
                self._free[slot] = seg
            else:
                seg.close()
        segments.clear()

    @property
    def cached_bytes(self) -> int:
        return sum(s.size for s in self._free.values())

    def close(self) -> None:
        """Unlinks every kept segment (idempotent); later releases unlink theirs at once."""
        self._closed = True
        while self._free:
            self._free.popitem()[1].close()


class ShmArena:
    """Arrays allocated directly in shared memory (Publisher.shm_empty): publishing one sends a
    reference to its segment instead of copying it. Each array has its own segment, kept until
    close(). Not thread-safe."""

    def __init__(self, prefix: str):
        self._base = f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}-a"
        self._segments: List[ShmSegment] = []
        self._starts: List[int] = []  # sorted mapping addresses, parallel to _segments

    def empty(self, shape, dtype) -> np.ndarray:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        seg = ShmSegment(f"{self._base}{len(self._segments)}", nbytes)
        i = bisect.bisect(self._starts, seg.address)
        self._starts.insert(i, seg.address)
        self._segments.insert(i, seg)
        return seg.array(shape, dtype)

    def find(self, address: int, nbytes: int) -> Optional[Tuple[ShmSegment, int]]:
        """(segment, offset) when [address, address + nbytes) lies inside one of the arena's
        segments, else None."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0:
            return None
        seg = self._segments[i]
        offset = address - seg.address
        return (seg, offset) if offset + nbytes <= seg.size else None

    def close(self) -> None:
        for seg in self._segments:
            seg.close()
        self._segments.clear()
        self._starts.clear()
