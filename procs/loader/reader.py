"""Cold, chunked reads of one byte range of a file (a safetensors data section).

A draft load must cost what it costs on a device that has not just read the file, so the
page cache is taken out of the picture: ``fsync`` (a read-only descriptor may fsync on
Linux; it makes pages the writer left dirty droppable) then ``posix_fadvise(DONTNEED)``
before reading and again afterwards, so the next load is cold too. ``O_DIRECT`` bypasses
the cache entirely; it needs block-aligned offsets, lengths and buffers, and the data
section starts at ``8 + header_len`` (not aligned), so it reads the aligned superset and
slices. Filesystems without ``O_DIRECT`` (tmpfs, some overlays) fall back to buffered
reads with a log line.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import threading
from collections.abc import Iterator

ALIGN = 4096  # covers 512-byte and 4 KiB logical blocks
IO_MODES = ("auto", "direct", "buffered")
RING = 4  # buffers: one being read, two queued, one being consumed
_warned: set[str] = set()


def log_once(key: str, text: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logging.getLogger(__name__).warning(text)


def drop_cache(fd: int) -> None:
    """Best effort: flush, then drop this file's cached pages."""
    try:
        os.fsync(fd)
    except OSError:
        pass
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass


class ColdReader:
    """Yields ``[start, start+size)`` of ``path`` as memoryviews of one reused buffer.

    Views rotate through ``ring`` buffers: each stays valid until ``ring - 1`` more have
    been requested (1 buffer: until the next one), which lets :func:`read_ahead` keep the
    disk busy while the consumer copies and hashes. ``mode`` is ``auto`` (O_DIRECT when
    the filesystem allows it), ``direct`` (same, but a refusal is still a fallback, logged)
    or ``buffered``. ``self.mode`` afterwards says which path actually ran.
    """

    def __init__(self, path: str | os.PathLike, start: int, size: int,
                 chunk: int = 1 << 20, mode: str = "auto", ring: int = 1,
                 buffer: mmap.mmap | None = None) -> None:
        if mode not in IO_MODES:
            raise ValueError(f"io mode must be one of {IO_MODES}, got {mode!r}")
        if chunk <= 0 or chunk % ALIGN:
            raise ValueError(f"chunk must be a positive multiple of {ALIGN}")
        self.path = os.fspath(path)
        self.start = start
        self.size = size
        self.chunk = chunk
        self.mode = "buffered" if mode == "buffered" else "direct"
        self._ring = max(1, ring)
        self._turn = 0
        # anonymous mmap: page-aligned, as O_DIRECT requires. A caller that reads many
        # files passes one buffer (`ring_buffer`) for all of them: a fresh mapping costs a
        # page fault per 4 KiB on first use, more CPU than the reads themselves.
        if buffer is not None and len(buffer) < chunk * self._ring:
            raise ValueError(f"buffer of {len(buffer)} bytes, the reader needs "
                             f"{chunk * self._ring}")
        self._buf = buffer if buffer is not None else mmap.mmap(-1, chunk * self._ring)
        self._view: memoryview | None = memoryview(self._buf)

    def _next(self, n: int) -> memoryview:
        """The next ring buffer's first ``n`` bytes (chunk-sized, so aligned)."""
        base = self._turn * self.chunk
        self._turn = (self._turn + 1) % self._ring
        return self._view[base:base + n]

    def __iter__(self) -> Iterator[memoryview]:
        if self._view is None:
            raise ValueError("reader is closed")
        if self.mode == "direct":
            fd = self._open_direct()
            if fd is not None:
                try:
                    yield from self._direct(fd)
                    return
                except _DirectRefused:
                    self.mode = "buffered"
                finally:
                    os.close(fd)
            else:
                self.mode = "buffered"
        yield from self._buffered()

    def close(self) -> None:
        """Drop the buffer (freed once the last yielded view is gone)."""
        self._view = None
        self._buf = None

    def _open_direct(self) -> int | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            log_once("direct-open", f"O_DIRECT refused on {self.path} ({exc.strerror}); "
                     "falling back to buffered reads after fadvise(DONTNEED)")
            return None
        drop_cache(fd)  # pages cached by earlier buffered readers would still be served
        return fd

    def _direct(self, fd: int) -> Iterator[memoryview]:
        first = self.start - self.start % ALIGN
        end = self.start + self.size
        pos = first
        while pos < end:
            want = min(self.chunk, end - pos)
            want += -want % ALIGN  # length must be aligned; the file's tail ends short
            buf = self._next(want)
            try:
                got = os.preadv(fd, [buf], pos)
            except OSError as exc:
                if exc.errno != errno.EINVAL or pos != first:
                    raise
                log_once("direct-read", f"O_DIRECT read refused on {self.path}; "
                         "falling back to buffered reads after fadvise(DONTNEED)")
                raise _DirectRefused from None
            lo = max(self.start - pos, 0)
            hi = min(got, end - pos)
            if hi <= lo:
                raise EOFError(f"{self.path} ended at byte {pos + got} of {end}")
            yield buf[lo:hi]
            pos += hi  # == pos + got when aligned; only the last chunk is short

    def _buffered(self) -> Iterator[memoryview]:
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            drop_cache(fd)
            pos, end = self.start, self.start + self.size
            while pos < end:
                want = min(self.chunk, end - pos)
                buf = self._next(want)
                got = os.preadv(fd, [buf], pos)
                if got <= 0:
                    raise EOFError(f"{self.path} ended at byte {pos} of {end}")
                yield buf[:got]
                pos += got
        finally:
            drop_cache(fd)
            os.close(fd)


def ring_buffer(chunk: int, ring: int = RING) -> mmap.mmap:
    """A reader buffer for ``ColdReader(buffer=...)``, its pages touched once here."""
    buf = mmap.mmap(-1, chunk * ring)
    buf.write(bytes(len(buf)))
    buf.seek(0)
    return buf


def read_ahead(reader: ColdReader) -> Iterator[memoryview]:
    """Iterate ``reader`` from a thread (``preadv`` drops the GIL) so reads overlap the
    consumer's copy and hash. Errors surface in the consumer; closing this generator
    (cancel) stops the thread and closes the file."""
    if reader._ring < 3:
        raise ValueError("read_ahead needs a reader with ring >= 3")
    q: queue.Queue = queue.Queue(maxsize=reader._ring - 2)
    stop = threading.Event()
    done = object()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def produce() -> None:
        chunks = iter(reader)
        try:
            for view in chunks:
                if not put(view):
                    return
            put(done)
        except BaseException as exc:  # handed to the consumer
            put(exc)
        finally:
            chunks.close()

    thread = threading.Thread(target=produce, name="loader-read-ahead", daemon=True)
    thread.start()
    try:
        while (item := q.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


class _DirectRefused(Exception):
    """The filesystem accepted O_DIRECT at open but refuses aligned reads."""
