"""Reading and writing a bubblewrap sandbox's own files from this process, without a command in it.

A file tool call through commands costs 2-4 processes in the sandbox (4-8 ms of CPU); most of a
prompt's file calls touch its working directory or its ``/tmp``, the prompt's own tmpfs mounts,
which this process can reach through ``/proc/<server pid>/root``. That path is only safe with
the kernel's own confinement, so every lookup goes through ``openat2(2)`` with
``RESOLVE_IN_ROOT`` (``..`` and absolute symlinks stay inside the sandbox's root, as they would
for a command) and ``RESOLVE_NO_MAGICLINKS`` (no ``/proc/<pid>/root`` or ``fd/N`` jumps), and
then only files on those two tmpfs mounts are touched:

* a file, or the directory a file is created in, must lie on one of them (its device number);
* the last path component is opened with ``O_NOFOLLOW`` when writing, and anything but a
  regular file (a FIFO, a directory) is left alone;
* permissions are those the sandbox's user would have without capabilities (this process may be
  root with all of them; the sandbox never is), checked before anything is truncated.

Whenever one of these does not hold, or anything fails, the answer is "not here" (None/False)
and the tool runs its usual commands inside the sandbox, which give the usual errors. So the
direct path never decides an error, it only speeds up what would have worked.
"""

from __future__ import annotations

import ctypes
import functools
import os
import posixpath
import stat

_SYS_OPENAT2 = 437  # the same number on every architecture (Linux 5.6's unified syscall table)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
_RESOLVE = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS
_MAX_DEPTH = 64  # directories a write may create at once


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


@functools.cache
def _libc_syscall():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.syscall
    fn.restype = ctypes.c_long
    return fn


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = _RESOLVE) -> int:
    """``openat2(2)``: a file descriptor, or OSError with the errno."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    fd = _libc_syscall()(
        _SYS_OPENAT2, ctypes.c_int(dirfd), ctypes.c_char_p(os.fsencode(path)), ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )  # fmt: skip
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)


@functools.cache
def openat2_available() -> bool:
    """Whether this kernel has openat2 with RESOLVE_IN_ROOT (Linux 5.6 and later), probed once."""
    root = os.open("/", os.O_PATH | os.O_CLOEXEC)
    try:
        os.close(openat2(root, ".", os.O_PATH | os.O_DIRECTORY))
    except (OSError, AttributeError):
        return False
    finally:
        os.close(root)
    return True


def _reopen(handle: int, flags: int) -> int:
    """Open the file an ``O_PATH`` handle refers to, with no new lookup of its path."""
    return os.open(f"/proc/self/fd/{handle}", flags | os.O_CLOEXEC | os.O_NOCTTY)


def _permitted(st: os.stat_result, want: int) -> bool:
    """Whether the sandbox's user (this uid, no capabilities) may ``want`` (R/W/X_OK bits) the file."""
    if st.st_uid == os.geteuid():
        bits = st.st_mode >> 6
    elif st.st_gid == os.getegid() or st.st_gid in os.getgroups():
        bits = st.st_mode >> 3
    else:
        bits = st.st_mode
    return bits & want == want


class DirectFiles:
    """The files of one sandbox seen from the host: ``root_fd`` is its ``/proc/<pid>/root``.

    ``workdir`` is where relative paths start (the commands' working directory) and ``home``
    what ``~`` means; ``devices`` are the device numbers of the mounts that may be touched.
    """

    def __init__(self, root_fd: int, workdir: str, home: str, devices: frozenset[int]):
        self.root_fd, self.workdir, self.home, self.devices = root_fd, workdir, home, devices

    @classmethod
    def open(cls, proc_root: str, workdir: str, home: str, mounts: tuple[str, ...]) -> DirectFiles | None:
        """For the sandbox whose root is ``proc_root``; None when openat2 is missing or a mount is not found."""
        if not openat2_available():
            return None
        try:
            root_fd = os.open(proc_root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        devices = set()
        for mount in mounts:
            try:
                fd = openat2(root_fd, mount, os.O_PATH | os.O_DIRECTORY)
            except OSError:
                os.close(root_fd)
                return None
            try:
                devices.add(os.fstat(fd).st_dev)
            finally:
                os.close(fd)
        return cls(root_fd, workdir, home, frozenset(devices))

    def close(self) -> None:
        fd, self.root_fd = self.root_fd, -1
        if fd >= 0:
            os.close(fd)

    def path_inside(self, path: str) -> str:
        """The tool's path as the sandbox's shell reads it (see ``file.shell_path``), made absolute."""
        if path == "~":
            return self.home
        if path.startswith("~/"):
            return posixpath.join(self.home, path[2:])
        return posixpath.join(self.workdir, path)

    def read(self, path: str, max_bytes: int) -> bytes | None:
        """The bytes of a readable regular file of at most ``max_bytes`` on the sandbox's own mounts, or None."""
        if self.root_fd < 0:
            return None
        try:
            # O_PATH first: nothing is opened for reading (a FIFO, a file in /proc) before it is checked.
            handle = openat2(self.root_fd, self.path_inside(path), os.O_PATH)
        except OSError:
            return None
        try:
            st = os.fstat(handle)
            if not (
                stat.S_ISREG(st.st_mode)
                and st.st_dev in self.devices
                and st.st_size <= max_bytes
                and _permitted(st, os.R_OK)
            ):
                return None
            fd = _reopen(handle, os.O_RDONLY)
        except OSError:
            return None
        finally:
            os.close(handle)
        try:
            parts, got = [], 0
            while got <= max_bytes:
                chunk = os.read(fd, max(st.st_size - got, 0) + 65536)
                if not chunk:
                    return b"".join(parts)
                parts.append(chunk)
                got += len(chunk)
            return None  # it grew past the limit meanwhile
        except OSError:
            return None
        finally:
            os.close(fd)

    def write(self, path: str, data: bytes, *, make_parents: bool) -> bool:
        """Write ``data`` as the whole content of a regular file on the sandbox's own mounts; False: not done.

        False may leave a new, empty file or new parent directories behind (what the commands
        that then run would have made too), never a partly replaced file of the sandbox's user
        that it could not have written.
        """
        if self.root_fd < 0:
            return False
        parent, name = posixpath.split(self.path_inside(path))
        if name in ("", ".", ".."):
            return False
        dir_fd = self._directory(parent, make_parents, _MAX_DEPTH)
        if dir_fd is None:
            return False
        try:
            fd = self._open_for_write(dir_fd, name)
        finally:
            os.close(dir_fd)
        if fd is None:
            return False
        try:
            os.ftruncate(fd, 0)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def _open_for_write(self, dir_fd: int, name: str) -> int | None:
        """``name`` in the directory, opened for writing: made new (``O_EXCL``, never through a
        symlink), or an existing regular file of the sandbox's own mounts the sandbox's user may
        write, checked through an ``O_PATH`` handle before it is opened at all. None: not here."""
        try:
            return os.open(
                name,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o666,  # less this process's umask, which the sandbox's shell inherits too
                dir_fd=dir_fd,
            )
        except FileExistsError:
            pass
        except OSError:
            return None
        try:
            handle = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            return None
        try:
            st = os.fstat(handle)  # a symlink is seen as one here (O_NOFOLLOW): not a regular file
            if not (stat.S_ISREG(st.st_mode) and st.st_dev in self.devices and _permitted(st, os.W_OK)):
                return None
            return _reopen(handle, os.O_WRONLY)
        except OSError:
            return None
        finally:
            os.close(handle)

    def _directory(self, path: str, make: bool, depth: int) -> int | None:
        """An O_PATH descriptor of directory ``path`` on the sandbox's own mounts, in which the sandbox's
        user may create files; made (``mkdir -p``) when missing and ``make``. None: not here."""
        try:
            fd = openat2(self.root_fd, path, os.O_PATH | os.O_DIRECTORY)
        except FileNotFoundError:
            parent, name = posixpath.split(path.rstrip("/"))
            if not make or depth <= 0 or name in ("", ".", ".."):
                return None
            up = self._directory(parent, make, depth - 1)
            if up is None:
                return None
            try:
                try:
                    os.mkdir(name, 0o777, dir_fd=up)
                except FileExistsError:
                    pass
                fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=up)
            except OSError:
                return None
            finally:
                os.close(up)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
        except OSError:
            st = None
        if st is None or st.st_dev not in self.devices or not _permitted(st, os.W_OK | os.X_OK):
            os.close(fd)
            return None
        return fd
