"""Sandbox backends, found by name and imported lazily (docker and modal only load when used).

``--sandbox`` takes a built-in name (``BACKENDS``), the name of a ``batch_runner.sandboxes`` entry
point of an installed package, or a dotted path ``package.module:Class``. Whatever it names must
subclass :class:`~batchrun.prompt.sandboxes.base.SandboxBackend`.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchrun.prompt.sandboxes.base import Sandbox, SandboxBackend, SandboxSpec

BACKENDS: dict[str, str] = {
    "local": "batchrun.prompt.sandboxes.local.sandbox:LocalSandbox",
    "docker": "batchrun.prompt.sandboxes.docker.sandbox:DockerSandbox",
    "singularity": "batchrun.prompt.sandboxes.singularity:SingularitySandbox",
    "modal": "batchrun.prompt.sandboxes.modal:ModalSandbox",
}
DEFAULT_BACKEND = "local"  # without --sandbox or TERMINAL_ENV
ENTRY_POINT_GROUP = "batch_runner.sandboxes"
EXTRAS = {"modal": "modal"}  # backend -> the extra that brings its SDK

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "ENTRY_POINT_GROUP",
    "ExecResult",
    "Sandbox",
    "SandboxBackend",
    "SandboxError",
    "SandboxSpec",
    "backend_class",
    "backend_names",
    "backend_target",
    "create_sandbox",
]


# The interface's names, imported on first use: the command line reads DEFAULT_BACKEND and a built-in's
# module before it starts the workers' forkserver (batchrun/run/forkserver.py), and this package's
# import is then only this table (base.py and importlib.metadata: ~20 ms sooner a server).
_FROM_BASE = ("ExecResult", "Sandbox", "SandboxBackend", "SandboxError", "SandboxSpec")


def __getattr__(name: str) -> Any:
    if name in _FROM_BASE:
        from batchrun.prompt.sandboxes import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _entry_points() -> dict[str, str]:
    from importlib import metadata

    return {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def backend_names() -> list[str]:
    """The backends ``--sandbox`` takes by name: the built-ins, then those of installed packages."""
    return [*BACKENDS, *sorted(set(_entry_points()) - set(BACKENDS))]


def backend_target(name: str) -> str:
    """``module:Class`` of backend ``name`` (a built-in never yields to an entry point of its name)."""
    if name in BACKENDS:
        return BACKENDS[name]
    if ":" in name:
        return name
    found = _entry_points().get(name)
    if found is None:
        raise ValueError(
            f"unknown sandbox backend {name!r}; valid backends: {', '.join(backend_names())}, "
            f"or a dotted path package.module:Class"
        )
    return found


@functools.cache
def backend_class(name: str) -> type[SandboxBackend]:
    """Import and return the class of a backend; an unknown name lists the valid ones."""
    from batchrun.prompt.sandboxes.base import SandboxBackend

    module_name, _, class_name = backend_target(name).partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        extra = EXTRAS.get(name)
        hint = f" (install it with: pip install 'batch-runner[{extra}]')" if extra else ""
        raise ValueError(f"sandbox backend {name!r} cannot be loaded: {exc}{hint}") from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, SandboxBackend)):
        raise ValueError(
            f"sandbox backend {name!r}: {module_name}:{class_name} is not a subclass of "
            "batchrun.prompt.sandboxes.SandboxBackend"
        )
    return cls


def create_sandbox(name: str, spec: SandboxSpec, options: dict[str, Any] | None = None) -> Sandbox:
    """Build (not start) a sandbox of backend ``name`` for ``spec`` with backend ``options``."""
    return backend_class(name)(spec, **(options or {}))  # type: ignore[call-arg]
