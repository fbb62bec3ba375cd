"""Sandbox backends, chosen by name and imported lazily (docker and modal only load when used)."""

from __future__ import annotations

import importlib
from typing import Any

from batchrun.prompt.sandboxes.base import ExecResult, Sandbox, SandboxError, SandboxSpec

BACKENDS: dict[str, str] = {
    "local": "batchrun.prompt.sandboxes.local:LocalSandbox",
    "docker": "batchrun.prompt.sandboxes.docker:DockerSandbox",
    "singularity": "batchrun.prompt.sandboxes.singularity:SingularitySandbox",
    "modal": "batchrun.prompt.sandboxes.modal:ModalSandbox",
}
EXTRAS = {"docker": "docker", "modal": "modal"}

__all__ = [
    "BACKENDS",
    "ExecResult",
    "Sandbox",
    "SandboxError",
    "SandboxSpec",
    "backend_class",
    "create_sandbox",
]


def backend_class(name: str) -> type:
    """Import and return the class of a backend; an unknown name lists the valid ones."""
    if name not in BACKENDS:
        raise ValueError(f"unknown sandbox backend {name!r}; valid backends: {', '.join(BACKENDS)}")
    module_name, _, class_name = BACKENDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        extra = EXTRAS.get(name)
        hint = f" (install it with: pip install 'batch-runner[{extra}]')" if extra else ""
        raise ValueError(f"sandbox backend {name!r} cannot be loaded: {exc}{hint}") from exc
    return getattr(module, class_name)


def create_sandbox(name: str, spec: SandboxSpec, options: dict[str, Any] | None = None) -> Sandbox:
    """Build (not start) a sandbox of backend ``name`` for ``spec`` with backend ``options``."""
    return backend_class(name)(spec, **(options or {}))
