"""The seccomp filter every local sandbox runs under: no kernel keyrings.

The sandbox runs as the runner's own user, and the kernel keeps a keyring per user (``@u``), not
per namespace of those the sandbox has: a prompt could read the keys the user's other programs keep
there, put a key in that another prompt (and the host) read, and leave it behind when it ended.
``add_key``, ``request_key`` and ``keyctl`` fail with ENOSYS, as on a kernel built without keys,
which every program using them handles (Docker's default profile refuses them too).

The filter is a classic BPF program (``struct sock_filter`` array), given to bubblewrap and to
br-launch alike as ``--seccomp FD``: a memory file each start reads and closes.
"""

from __future__ import annotations

import errno
import functools
import os
import struct

# Each architecture a process of this machine may call the kernel in (its own and its compat ABI):
# AUDIT_ARCH_* value, and the numbers of add_key, request_key and keyctl there.
_KEYRING_CALLS = {
    0xC000003E: (248, 249, 250),  # x86_64 (x32's calls are these with bit 30 set: masked below)
    0x40000003: (286, 287, 288),  # i386
    0xC00000B7: (217, 218, 219),  # aarch64
    0x40000028: (309, 310, 311),  # arm (EABI)
    0xC00000F3: (217, 218, 219),  # riscv64
}
_X32_BIT = 0x40000000

_LD_W_ABS, _JEQ_K, _AND_K, _RET_K = 0x20, 0x15, 0x54, 0x06  # BPF_LD|W|ABS, JMP|JEQ|K, ALU|AND|K, RET|K
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_NR, _ARCH = 0, 4  # offsets in struct seccomp_data


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


@functools.cache
def keyring_filter() -> bytes:
    """The program: for each architecture above, its three keyring calls fail with ENOSYS; all else runs."""
    prog = [_op(_LD_W_ABS, _ARCH)]
    for arch, calls in _KEYRING_CALLS.items():
        body = [_op(_LD_W_ABS, _NR)]
        if arch == 0xC000003E:
            body.append(_op(_AND_K, ~_X32_BIT & 0xFFFFFFFF))
        body += [_op(_JEQ_K, nr, jt=len(calls) - i) for i, nr in enumerate(calls)]
        body += [_op(_RET_K, _RET_ALLOW), _op(_RET_K, _RET_ERRNO | errno.ENOSYS)]
        # Another architecture skips this body, its accumulator still holding the architecture.
        prog.append(_op(_JEQ_K, arch, jf=len(body)))
        prog += body
    prog.append(_op(_RET_K, _RET_ALLOW))
    return b"".join(prog)


def keyring_filter_fd() -> int:
    """A descriptor to pass as ``--seccomp FD`` (inheritable, at its start): the caller closes it."""
    fd = os.memfd_create("br-seccomp", 0)
    try:
        os.write(fd, keyring_filter())
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd
