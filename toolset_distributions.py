"""The toolset distributions as the reference's ``toolset_distributions`` module offers them, for scripts
written for it; the data and the runner's own (seeded) sampling live in batchrun.distributions.

    from toolset_distributions import get_distribution, sample_toolsets_from_distribution
    dist = get_distribution("research")          # None for an unknown name, as in the reference
    dist["description"], dist["toolsets"]        # also dist.description, dist.probabilities
    sample_toolsets_from_distribution("research")  # one draw with the random module; ValueError if unknown

python toolset_distributions.py        # print every distribution, as --list_distributions does
"""

from __future__ import annotations

import random

from batchrun import distributions as _impl
from batchrun.distributions import *  # noqa: F403  (re-exported for scripts that import this module)
from batchrun.distributions import DISTRIBUTIONS, Distribution, format_distributions

__all__ = [
    "DISTRIBUTIONS",
    "Distribution",
    "ReferenceDistribution",
    "get_distribution",
    "list_distributions",
    "print_distribution_info",
    "prompt_rng",
    "sample_toolsets_from_distribution",
    "validate_distribution",
]

prompt_rng = _impl.prompt_rng


class ReferenceDistribution(dict):
    """A distribution as the reference's dict, ``{"description": ..., "toolsets": {toolset: percent}}``
    (``in``, iteration, ``.items()``, ``json.dumps`` all work on it), also read as ``.name``,
    ``.description`` and ``.probabilities``. A copy: changing it changes no run."""

    def __init__(self, dist: Distribution) -> None:
        super().__init__(description=dist.description, toolsets=dict(dist.probabilities))
        self.name = dist.name

    @property
    def description(self) -> str:
        return self["description"]

    @property
    def probabilities(self) -> dict[str, int]:
        return self["toolsets"]


def get_distribution(name: str) -> ReferenceDistribution | None:
    """The distribution called ``name`` as the reference's dict, or None if there is none."""
    try:
        return ReferenceDistribution(_impl.get_distribution(name))
    except ValueError:
        return None


def list_distributions() -> dict[str, ReferenceDistribution]:
    """Every distribution by name (the built-ins in their documented order, then a run's file's), each
    as the reference's dict; a copy."""
    return {name: ReferenceDistribution(dist) for name, dist in _impl.list_distributions().items()}


def validate_distribution(distribution: str | Distribution | ReferenceDistribution) -> bool:
    """Whether a distribution name is valid (the reference's check). A :class:`Distribution`, or what
    :func:`get_distribution` gave, is checked whole instead and raises ValueError naming what is wrong (batchrun.distributions.validate_distribution)."""
    if isinstance(distribution, ReferenceDistribution):  # what get_distribution gave, edited or not
        distribution = Distribution(
            distribution.name,
            str(distribution.get("description") or ""),
            dict(distribution.get("toolsets") or {}),
        )
    if isinstance(distribution, Distribution):
        _impl.validate_distribution(distribution)
        return True
    # None, a number: False, as in the reference (which raises TypeError for a dict; False here)
    return isinstance(distribution, str) and distribution in _impl.list_distributions()


def sample_toolsets_from_distribution(name: str, rng: random.Random | None = None, **kwargs) -> list[str]:
    """One draw: each toolset by its own probability, the most probable one if none came up.

    ValueError for an unknown name. Without ``rng`` it uses the ``random`` module, as the reference does."""
    return _impl.sample_toolsets_from_distribution(name, rng, **kwargs)


def print_distribution_info(name: str) -> None:
    """Print a distribution's description and its toolsets' probabilities, most probable first."""
    dist = get_distribution(name)
    if dist is None:
        print(f"Unknown distribution: {name}")
        return
    print(f"\nDistribution: {name}")
    print(f"   Description: {dist.description}")
    print("   Toolsets:")
    for toolset, percent in sorted(dist.probabilities.items(), key=lambda item: -item[1]):
        print(f"     - {toolset:15} : {percent:3}% chance")


if __name__ == "__main__":
    print(format_distributions())
