"""The local backend: each prompt in its own bubblewrap sandbox, or (on purpose) plain host processes.

Its parts, each a module of its own:

- ``options``: ``LocalOptions`` (the backend's settings) and the names the parts share;
- ``host``: probes of this machine (bubblewrap, user-mode networking, the host's own addresses);
- ``system_view``: the namespaces and the read-only system every sandbox sees, the masked /etc view;
- ``launcher``: br-launch, the sandbox's bubblewrap line run without bwrap, as root (half the CPU);
- ``limits``: the prompt's cgroup (or rlimits where the machine offers no cgroups);
- ``netlink``: the routes that keep the host's own addresses out of reach;
- ``network_hub``: one slirp4netns per worker, each prompt on a link of its own into it (root);
- ``command_server``: the resident shell that runs a prompt's commands;
- ``process_tree``: finding and killing what a sandbox left behind;
- ``direct_files``: the file tools' reads and writes into the sandbox's tmpfs without a command;
- ``sandbox``: ``LocalSandbox``, which puts them together.
"""

from batchrun.prompt.sandboxes.local.host import bwrap_problem, local_isolation_available
from batchrun.prompt.sandboxes.local.options import ISOLATION_MODES, LocalOptions
from batchrun.prompt.sandboxes.local.sandbox import LocalSandbox

__all__ = ["ISOLATION_MODES", "LocalOptions", "LocalSandbox", "bwrap_problem", "local_isolation_available"]
