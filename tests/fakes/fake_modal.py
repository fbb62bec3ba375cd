"""A fake of the few ``modal`` SDK calls the Modal backend uses, run locally (installed as ``modal`` by a fixture).

Each Sandbox is a busybox root filesystem entered with bubblewrap; ``calls`` records every
SDK call with its arguments, so tests can check what the backend asked Modal for.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from fake_rootfs import container_argv, container_env, make_rootfs

calls: list[tuple[str, dict[str, Any]]] = []
MAX_BUFFER_SIZE = 128 * 1024  # like the SDK: write() refuses to buffer more than this before drain()


class NotFoundError(Exception):
    pass


class App:
    def __init__(self, name: str):
        self.name = name

    @staticmethod
    def lookup(name: str, *, create_if_missing: bool = False, environment_name: str | None = None) -> App:
        calls.append(("App.lookup", {"name": name, "create_if_missing": create_if_missing}))
        return App(name)


class Image:
    def __init__(self, tag: str):
        self.tag = tag

    @staticmethod
    def from_registry(tag: str, **kwargs: Any) -> Image:
        calls.append(("Image.from_registry", {"tag": tag, **kwargs}))
        return Image(tag)


class Secret:
    def __init__(self, env: dict[str, str]):
        self.env = env

    @staticmethod
    def from_dict(env_dict: dict[str, str]) -> Secret:
        calls.append(("Secret.from_dict", {"keys": sorted(env_dict)}))
        return Secret(dict(env_dict))


class StreamWriter:
    def __init__(self, pipe):
        self._pipe, self._buffer, self._eof = pipe, bytearray(), False

    def write(self, data: bytes) -> None:
        if self._eof:
            raise EOFError("Stdin is closed. Cannot write to it.")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data argument must be a bytes-like object, not {type(data).__name__}")
        if len(self._buffer) + len(data) > MAX_BUFFER_SIZE:
            raise BufferError("Buffer size exceed limit. Call drain to clear the buffer.")
        self._buffer.extend(data)

    def write_eof(self) -> None:
        self._eof = True

    def drain(self) -> None:
        data, self._buffer = bytes(self._buffer), bytearray()
        try:
            if data:
                self._pipe.write(data)
                self._pipe.flush()
            if self._eof:
                self._pipe.close()
        except (BrokenPipeError, ValueError):
            pass


class StreamReader:
    def __init__(self, pipe, text: bool):
        self._pipe, self._text = pipe, text

    def _decode(self, data: bytes):
        return data.decode(errors="replace") if self._text else data

    def read(self):
        return self._decode(self._pipe.read())

    def __iter__(self):
        for chunk in iter(lambda: os.read(self._pipe.fileno(), 65536), b""):
            yield self._decode(chunk)


class ContainerProcess:
    def __init__(self, popen: subprocess.Popen, text: bool, timeout: int | None):
        self._popen = popen
        self.stdin = StreamWriter(popen.stdin)
        self.stdout = StreamReader(popen.stdout, text)
        self.stderr = StreamReader(popen.stderr, text)
        if timeout:  # like Modal: the exec is ended server-side after its timeout
            timer = threading.Timer(timeout, _kill_group, args=(popen.pid,))
            timer.daemon = True
            timer.start()

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def poll(self) -> int | None:
        return self._popen.poll()

    def wait(self) -> int:
        return self._popen.wait()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Sandbox:
    def __init__(self, root: Path, network: bool, env: dict[str, str]):
        self.root, self.network, self.env = root, network, env
        self._procs: list[subprocess.Popen] = []
        self.terminated = False

    @staticmethod
    def create(
        *args: str,
        app: App | None = None,
        image: Image | None = None,
        secrets: list[Secret] = (),
        timeout: int = 300,
        workdir: str | None = None,
        cpu: float | None = None,
        memory: int | None = None,
        block_network: bool = False,
    ) -> Sandbox:
        calls.append(("Sandbox.create", {"args": args, "app": app and app.name, "image": image and image.tag,
                                         "timeout": timeout, "workdir": workdir, "cpu": cpu, "memory": memory,
                                         "block_network": block_network}))  # fmt: skip
        if image is not None and "does-not-exist" in image.tag:
            raise NotFoundError(f"Image {image.tag} could not be pulled")
        root = Path(tempfile.mkdtemp(prefix="fake-modal-"))
        make_rootfs(root)
        env: dict[str, str] = {}
        for secret in secrets:
            env.update(secret.env)
        return Sandbox(root, not block_network, env)

    def exec(
        self,
        *args: str,
        timeout: int | None = None,
        workdir: str | None = None,
        text: bool = True,
        stdout: Any = None,
        stderr: Any = None,
        secrets: list[Secret] = (),
        bufsize: int = -1,
    ) -> ContainerProcess:
        calls.append(("Sandbox.exec", {"args": args, "timeout": timeout, "workdir": workdir, "text": text}))
        if self.terminated:
            raise RuntimeError("Sandbox has already been terminated")
        argv = container_argv(self.root, pwd=workdir, network=self.network) + list(args)
        popen = subprocess.Popen(
            argv, env=container_env(self.env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        self._procs.append(popen)
        return ContainerProcess(popen, text, timeout)

    def terminate(self) -> None:
        calls.append(("Sandbox.terminate", {}))
        self.terminated = True
        for popen in self._procs:
            _kill_group(popen.pid)
        shutil.rmtree(self.root, ignore_errors=True)
