"""The page cache of the Python benchmarks: how much of some files is cached (mincore), evicting
them (fdatasync, then posix_fadvise(POSIX_FADV_DONTNEED), and as root drop_caches when that left
more than 1% cached), warming them (reading them through), and whether they are on a file system
whose pages cannot be evicted (tmpfs, ramfs: the pages are the files)."""
import ctypes
import os
import re

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def cached_fraction(paths, empty=1.0):
    """Fraction of the files' pages in the page cache (mincore); `empty` where they have none."""
    page = os.sysconf("SC_PAGE_SIZE")
    cached = pages = 0
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), "mmap failed", path)
            n = (size + page - 1) // page
            vec = ctypes.create_string_buffer(n)
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed", path)
            cached += sum(b & 1 for b in vec.raw)
            pages += n
            _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return cached / pages if pages else empty


def evict(paths, empty=1.0):
    """Evicts the files from the page cache; returns the fraction still cached (check it: pages
    of a file on tmpfs cannot be evicted)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            # Dirty pages (a checkpoint just written, `gen --no-sync`) are not dropped by
            # DONTNEED: written back first, they are.
            try:
                os.fdatasync(fd)
            except OSError:
                pass  # a file system without fsync (some FUSE ones): nothing to write back
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    left = cached_fraction(paths, empty)
    if left > 0.01 and os.geteuid() == 0:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        left = cached_fraction(paths, empty)
    return left


def warm(paths, empty=1.0, unless_cached=False):
    """Reads the files through (with `unless_cached`, only when less than 99% is cached); returns
    the fraction cached."""
    if not unless_cached or cached_fraction(paths, empty) < 0.99:
        for path in paths:
            with open(path, "rb", buffering=0) as f:
                while f.read(16 << 20):
                    pass
    return cached_fraction(paths, empty)


UNEVICTABLE = ("tmpfs", "ramfs")


def filesystem_type(path):
    """The type of the file system holding `path` ("ext4", "tmpfs", ...; "" when unknown), from
    /proc/self/mounts: the mount point that is the longest prefix of its real path."""
    real = os.path.realpath(path)
    best, kind = -1, ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                # Spaces and the like are octal escapes in /proc/self/mounts ("\040").
                point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= best:  # the later of equal ones is on top
                    best, kind = len(point), fields[2]
    except OSError:
        return ""
    return kind


def unevictable(paths):
    """The first of `paths` on a file system whose pages cannot be evicted (tmpfs, ramfs), with
    its type, as (path, type); None when there is none."""
    for path in paths:
        kind = filesystem_type(path)
        if kind in UNEVICTABLE:
            return path, kind
    return None
