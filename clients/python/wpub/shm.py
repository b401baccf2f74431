"""POSIX shared-memory segments holding the host parts of one publication.

A segment is created per conversion batch (sized to the batch's large host parts), filled with
one copy per part, described to the daemon by name/offset/length, and unlinked once the
publication's report arrived (the daemon maps segments while the publication is open and reads
them at commit, so their contents must not change before then). Segments are files under
/dev/shm, which is what shm_open(3) uses on Linux; going through the file system directly
avoids multiprocessing's resource tracker (an extra process that unlinks "leaked" segments)."""

import mmap
import os
import secrets
from typing import List

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


class ShmSegments:
    """Every segment of one publication; `close()` unlinks them all."""

    def __init__(self, prefix: str, version: int):
        self._prefix = f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}-v{version}"
        self._segments: List[ShmSegment] = []
        self.bytes = 0

    def create(self, batch_index: int, size: int) -> ShmSegment:
        seg = ShmSegment(f"{self._prefix}-b{batch_index}", size)
        self._segments.append(seg)
        self.bytes += size
        return seg

    def close(self) -> None:
        while self._segments:
            self._segments.pop().close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
