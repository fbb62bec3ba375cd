"""The Docker backend: one labelled container per prompt, its commands run by a server inside it.

- ``sandbox``: ``DockerSandbox`` and its options;
- ``engine``: the run-level steps against the engine (checks, images, sweeping a run's containers);
- ``container_server``: the ``sh`` command server inside each container and its wire format.
"""

from batchrun.prompt.sandboxes.docker.sandbox import DockerOptions, DockerSandbox

__all__ = ["DockerOptions", "DockerSandbox"]
