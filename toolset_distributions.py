"""The toolset distributions (compatibility entry point): the data and sampling live in batchrun.distributions.

python toolset_distributions.py        # print every distribution, as --list_distributions does
"""

from batchrun.distributions import *  # noqa: F403  (re-exported for scripts that import this module)
from batchrun.distributions import format_distributions

if __name__ == "__main__":
    print(format_distributions())
