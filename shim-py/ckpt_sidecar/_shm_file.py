"""The file objects the hook's CUDA way serialises a skip_data skeleton
into: regions of a pool of shared memory (`ShmPool`: reused, their pages
warm; at most MAX busy), so the bytes reach the sidecar with no copy in
between. `ShmFile` grows into a
larger region when the bytes outgrow it; `PiecedFile` records what torch.save
writes under skip_data and the holes it leaves for storages' bytes."""

import ctypes
import io
import threading


class ShmPool:
    """Shared-memory regions torch.save serialises into, so the bytes reach the
    sidecar with no copy in between; reused (their pages stay warm). A region
    is busy from its torch.save until its file is durable (the fallback write
    reads it); with MAX busy, the next torch.save waits for the oldest."""

    MAX = 2

    def __init__(self, ck):
        self._ck = ck
        self._free = []
        self._count = 0
        self._cv = threading.Condition()

    def _alloc(self, n):
        # A hand-over region: written only to fill a file before it is sent,
        # never again until that file is durable, so the sidecar writes the
        # file even if this process dies before Released (protocol.md).
        with self._ck._mu:  # the Checkpointer's region table
            return self._ck._alloc(max(n + n // 8, 1 << 20), hand_over=True)

    def _drop(self, r):
        with self._ck._mu:
            self._ck._free_region(r)

    def take(self, n):
        with self._cv:
            while True:
                fits = [r for r in self._free if r.len_bytes >= n]
                if fits:
                    r = min(fits, key=lambda r: r.len_bytes)
                    self._free.remove(r)
                    return r
                if self._free:  # too small: replace the smallest by a larger one
                    self._drop(self._free.pop(self._free.index(min(self._free, key=lambda r: r.len_bytes))))
                    self._count -= 1
                if self._count < self.MAX:
                    r = self._alloc(n)
                    self._count += 1
                    return r
                self._cv.wait()

    def give(self, r):
        with self._cv:
            self._free.append(r)
            self._cv.notify_all()

    def grow(self, r, used, n):
        """A region of at least n bytes holding the `used` first bytes of r (dropped)."""
        new = self._alloc(max(n, 2 * r.len_bytes))
        ctypes.memmove(new.ptr, r.ptr, used)
        self._drop(r)
        return new


class ShmFile:
    """The file-like object torch.save writes into: a region of the pool,
    grown (moved to a larger one) when the bytes outgrow it."""

    def __init__(self, pool, size_hint):
        import numpy  # loaded by the Checkpointer already; not at interpreter start

        self._frombuffer, self._u8 = numpy.frombuffer, numpy.uint8
        self._pool = pool
        self.region = pool.take(size_hint)
        self.len_bytes = 0

    def write(self, b):
        src = self._frombuffer(memoryview(b).cast("B"), dtype=self._u8)
        n = src.nbytes
        if self.len_bytes + n > self.region.len_bytes:
            # /dev/shm full raises SidecarError: the caller serialises in private memory.
            self.region = self._pool.grow(self.region, self.len_bytes, self.len_bytes + n)
        if n:
            ctypes.memmove(self.region.ptr + self.len_bytes, src.ctypes.data, n)
        self.len_bytes += n
        return n

    def flush(self):
        pass

    def view(self):
        """The bytes written (for this process's own write of the file)."""
        return memoryview((ctypes.c_char * self.len_bytes).from_address(self.region.ptr)).cast("B")

    def release(self):
        if self.region is not None:
            self._pool.give(self.region)
            self.region = None


class PiecedFile(ShmFile):
    """What torch.save writes under skip_data, in a region of the pool: the
    bytes it writes (the archive's skeleton), packed, and the holes it seeks
    over (one per storage with bytes, in storage-key order), so each file
    byte is either here or in a storage."""

    def __init__(self, pool, size_hint):
        super().__init__(pool, size_hint)
        self.pos = 0  # the file's length so far
        self.runs = []  # (file offset, region offset, length) of bytes held here
        self.holes = []  # (file offset, length) left for a storage's bytes

    def write(self, b):
        at = self.len_bytes
        n = super().write(b)
        if n:
            if (
                self.runs
                and self.runs[-1][0] + self.runs[-1][2] == self.pos
                and self.runs[-1][1] + self.runs[-1][2] == at
            ):
                f, r, m = self.runs[-1]
                self.runs[-1] = (f, r, m + n)
            else:
                self.runs.append((self.pos, at, n))
            self.pos += n
        return n

    def seek(self, offset, whence=io.SEEK_SET):
        # skip_data's only seek: past a storage's bytes (see torch's
        # write_record_metadata); anything else is not this layout.
        if whence != io.SEEK_CUR or offset < 0:
            raise io.UnsupportedOperation(f"seek({offset}, {whence}) while torch.save wrote under skip_data")
        if offset:
            self.holes.append((self.pos, offset))
            self.pos += offset
        return self.pos

    def tell(self):
        return self.pos

    def fill(self, file_offset, ptr, n):
        """Host bytes for the hole at `file_offset` (a CPU storage's)."""
        at = self.len_bytes
        ShmFile.write(self, (ctypes.c_ubyte * n).from_address(ptr))
        self.runs.append((file_offset, at, n))
