"""A tiny stand-in for a container, shared by the fakes: a busybox root filesystem entered with bubblewrap."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path


@functools.cache
def _busybox() -> tuple[str, tuple[str, ...]]:
    path = shutil.which("busybox")
    if path is None:
        raise RuntimeError("the fakes need busybox (Debian: busybox-static)")
    applets = subprocess.run([path, "--list"], capture_output=True, text=True, check=True).stdout.split()
    return path, tuple(applets)


def available() -> bool:
    """Whether this machine can run the fakes (busybox and a working bwrap)."""
    return shutil.which("busybox") is not None and shutil.which("bwrap") is not None


def make_rootfs(root: Path) -> None:
    """A minimal root filesystem: busybox with its applets linked in /bin, /tmp, /root, /etc."""
    busybox, applets = _busybox()
    for sub in ("bin", "tmp", "root", "etc", "proc", "dev"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "tmp").chmod(0o1777)
    shutil.copy2(busybox, root / "bin" / "busybox")
    for applet in applets:
        link = root / "bin" / applet
        if not link.exists():
            link.symlink_to("busybox")
    (root / "usr").mkdir(exist_ok=True)
    if not (root / "usr" / "bin").exists():
        (root / "usr" / "bin").symlink_to("../bin")


def container_argv(root: Path, *, pwd: str | None, network: bool = True) -> list[str]:
    """bwrap arguments that run a command with ``root`` as its whole filesystem, in its own PID namespace."""
    argv = ["bwrap", "--bind", str(root), "/", "--proc", "/proc", "--dev", "/dev"]
    argv += ["--unshare-pid", "--die-with-parent", "--new-session"]
    if not network:
        argv.append("--unshare-net")
    if pwd:
        argv += ["--chdir", pwd]
    return [*argv, "--"]


def container_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {"PATH": "/bin:/usr/bin", "HOME": "/root", **(extra or {})}


def exists_in(root: Path, path: str) -> bool:
    return os.path.exists(root / path.lstrip("/"))
