"""Toolset distributions: which toolsets each prompt is offered, as data.

A distribution gives every toolset it mentions an independent inclusion probability in
percent. For each prompt the sampler flips one coin per toolset; if every flip fails, the
most probable toolset is offered alone, so no prompt runs without tools.
"""

from __future__ import annotations

import difflib
import json
import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from batchrun.identity import prompt_rng  # noqa: F401  (re-exported: scripts import it from here)
from batchrun.prompt.tools.registry import TOOLSETS
from batchrun.sharegpt import parse_json, unique_keys


@dataclass(frozen=True)
class Distribution:
    """A named mix of toolsets, each with its inclusion probability in percent (1-100)."""

    name: str
    description: str
    probabilities: Mapping[str, int]  # toolset -> percent, in the order the sampler flips them

    # Read as the reference's dict too (``dist["description"]``, ``dist["toolsets"]``), for scripts written for it.
    def keys(self) -> tuple[str, ...]:
        return ("description", "toolsets")

    def __getitem__(self, key: str) -> object:
        if key == "description":
            return self.description
        if key == "toolsets":
            return dict(self.probabilities)
        raise KeyError(key)

    def get(self, key: str, default: object = None) -> object:
        return self[key] if key in self.keys() else default


def _entry(name: str, description: str, **probabilities: int) -> Distribution:
    return Distribution(name, description, MappingProxyType(dict(probabilities)))


_ALL = dict.fromkeys(TOOLSETS, 100)
_HALF = dict.fromkeys(TOOLSETS, 50)

# The names and numbers are the users' documented interface: change them only on purpose.
_ENTRIES = (
    _entry("default", "Every toolset on every prompt.", **_ALL),
    _entry(
        "image_gen",
        "Picture making and looking, with some web lookups and shell work.",
        image_gen=90,
        vision=90,
        web=55,
        terminal=45,
        moa=10,
    ),
    _entry(
        "research",
        "Finding and reading sources on the web, often through a real browser.",
        web=90,
        browser=70,
        vision=50,
        moa=40,
        terminal=10,
    ),
    _entry(
        "science",
        "Look things up, then compute and keep results in files.",
        web=94,
        terminal=94,
        file=94,
        vision=65,
        browser=50,
        image_gen=15,
        moa=10,
    ),
    _entry(
        "development",
        "Writing and running code in the sandbox, with occasional documentation lookups.",
        terminal=80,
        file=80,
        moa=60,
        web=30,
        vision=10,
    ),
    _entry(
        "safe",
        "Everything except shell access: for prompts that must not run commands.",
        web=80,
        browser=70,
        vision=60,
        image_gen=60,
        moa=50,
    ),
    _entry("balanced", "A fair coin for each toolset: a broad, unbiased mix.", **_HALF),
    _entry("minimal", "Web search and extraction only.", web=100),
    _entry("terminal_only", "Shell and file editing in the sandbox, nothing online.", terminal=100, file=100),
    _entry(
        "terminal_web",
        "Shell and file editing plus web lookups.",
        terminal=100,
        file=100,
        web=100,
    ),
    _entry(
        "creative",
        "Generating and inspecting images, with a little web inspiration.",
        image_gen=90,
        vision=90,
        web=30,
    ),
    _entry(
        "reasoning",
        "Hard thinking with the mixture-of-agents tool, rarely anything else.",
        moa=90,
        web=30,
        terminal=20,
    ),
    _entry(
        "browser_use", "Driving a browser, helped by search and screenshots.", browser=100, web=80, vision=70
    ),
    _entry("browser_only", "The browser and nothing else.", browser=100),
    _entry(
        "browser_tasks",
        "Browser tasks, seldom needing vision or a shell.",
        browser=97,
        vision=12,
        terminal=15,
    ),
    _entry(
        "terminal_tasks",
        "Sandbox tasks that usually also need the web, often a browser.",
        terminal=97,
        file=97,
        web=97,
        browser=75,
        vision=50,
        image_gen=10,
    ),
    _entry(
        "mixed_tasks",
        "Tasks that combine the browser with shell and files.",
        browser=92,
        terminal=92,
        file=92,
        web=35,
        vision=15,
        image_gen=15,
    ),
)


def validate_distribution(dist: Distribution, known: Collection[str] = TOOLSETS) -> None:
    """Raise ValueError, naming the distribution and the field, if `dist` is malformed.

    ``known``: the toolset names it may use (the built-ins; for a --distribution_file also plugin
    and MCP toolsets)."""
    if not dist.name:
        raise ValueError("distribution with empty name")
    if not dist.description.strip():
        raise ValueError(f"distribution {dist.name!r}: field 'description' is empty")
    if not dist.probabilities:
        raise ValueError(f"distribution {dist.name!r}: field 'probabilities' names no toolset")
    for toolset, percent in dist.probabilities.items():
        if toolset not in known:
            raise ValueError(
                f"distribution {dist.name!r}: field 'probabilities' names unknown toolset {toolset!r}"
                f" (known: {', '.join(known)})"
            )
        if isinstance(percent, bool) or not isinstance(percent, int) or not 0 < percent <= 100:
            raise ValueError(
                f"distribution {dist.name!r}: field 'probabilities' gives {toolset!r} {percent!r};"
                " expected an integer percent in 1..100"
            )


def _build(entries: tuple[Distribution, ...]) -> dict[str, Distribution]:
    table: dict[str, Distribution] = {}
    for dist in entries:
        validate_distribution(dist)
        if dist.name in table:
            raise ValueError(f"distribution {dist.name!r}: field 'name' is used twice")
        table[dist.name] = dist
    return table


DISTRIBUTIONS: dict[str, Distribution] = _build(_ENTRIES)

# The run's --distribution_file entries (set by the run's configuration; empty without one).
_FROM_FILE: dict[str, Distribution] = {}


def get_distribution(name: str) -> Distribution:
    """The distribution called `name`; ValueError naming the close ones (a typo) and listing the valid names otherwise."""
    found = DISTRIBUTIONS.get(name) or _FROM_FILE.get(name)
    if found is None:
        names = list(list_distributions())
        by_lower = {n.lower(): n for n in names}
        close = [by_lower[c] for c in difflib.get_close_matches(str(name).lower(), by_lower, n=3, cutoff=0.6)]
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        raise ValueError(f"unknown toolset distribution {name!r}{hint}; valid names: {', '.join(names)}")
    return found


def list_distributions() -> dict[str, Distribution]:
    """All distributions by name: the built-ins in their documented order, then the file's (a copy)."""
    return {**DISTRIBUTIONS, **_FROM_FILE}


def _unique_key_loader(yaml: Any) -> Any:
    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
            twice = sorted({str(k) for k in keys if keys.count(k) > 1})
            if twice:
                raise ValueError(f"{twice[0]!r} is defined twice")
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def load_distribution_file(path: str, known: Collection[str]) -> dict[str, Distribution]:
    """The named distributions of a JSON (or, with PyYAML installed, YAML) file, checked.

    The file maps each name to ``{"description": ..., "probabilities": {toolset: percent}}``, the
    shape of the built-ins. ValueError naming the file, the distribution and the field otherwise.
    """
    from pathlib import Path

    from batchrun.storage import read_flag_file

    text = read_flag_file(path)  # ValueError naming the path
    if Path(path).suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ValueError(
                f"{path}: reading YAML needs PyYAML (pip install pyyaml); or write it as JSON"
            ) from None
        try:
            data = yaml.load(text, Loader=_unique_key_loader(yaml))  # noqa: S506 - a SafeLoader subclass
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from None
        except ValueError as exc:  # a name defined twice
            raise ValueError(f"{path}: {exc}") from None
    else:
        try:
            # A distribution (or a toolset) defined twice is an error, not the last definition silently.
            data = parse_json(text, object_pairs_hook=unique_keys)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
        except ValueError as exc:  # a name defined twice, a number or nesting too large to read
            raise ValueError(f"{path}: {exc}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(
            f'{path}: expected an object of named distributions, {{"name": {{"description": ..., '
            f'"probabilities": {{"terminal": 100, ...}}}}}}'
        )
    table: dict[str, Distribution] = {}
    for name, entry in data.items():
        where = f"{path}: distribution {name!r}"
        if name in DISTRIBUTIONS:
            raise ValueError(f"{where}: the name is a built-in distribution's; choose another")
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected an object with 'description' and 'probabilities'")
        unknown = sorted(set(entry) - {"description", "probabilities"})
        if unknown:
            raise ValueError(f"{where}: unknown field {unknown[0]!r} (fields: description, probabilities)")
        description = entry.get("description", f"From {Path(path).name}.")
        probabilities = entry.get("probabilities")
        if not isinstance(description, str):
            raise ValueError(f"{where}: field 'description' must be text")
        if not isinstance(probabilities, dict):
            raise ValueError(f"{where}: field 'probabilities' must be an object of toolset -> percent")
        dist = Distribution(str(name), description, MappingProxyType(dict(probabilities)))
        try:
            validate_distribution(dist, known)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        table[dist.name] = dist
    return table


def use_file_distributions(table: dict[str, Distribution]) -> None:
    """Make ``table`` (a run's --distribution_file, or empty) the distributions beyond the built-ins."""
    _FROM_FILE.clear()
    _FROM_FILE.update(table)


def sample_toolsets_from_distribution(
    name: str,
    rng: random.Random | None = None,
    available: Collection[str] | None = None,
    unavailable: list[str] | None = None,
) -> list[str]:
    """Flip one coin per toolset; if none comes up, offer the most probable toolset alone.

    ``available``: only these toolsets can be offered here; the guarantee of at least one then holds
    among them (none only when the distribution has no available toolset at all). Toolsets that came
    up but are not available are appended to ``unavailable`` when it is given. ``rng``: the draw's
    randomness (the runner's is seeded per prompt); None: the ``random`` module's, as the reference samples.
    """
    draw = rng.random if rng is not None else random.random
    probabilities = get_distribution(name).probabilities
    # Always draw once per toolset so the rng stream does not depend on earlier outcomes.
    drawn = [toolset for toolset, percent in probabilities.items() if draw() * 100 < percent]
    offerable = [t for t in probabilities if available is None or t in available]
    chosen = [t for t in drawn if t in offerable]
    if unavailable is not None:
        unavailable.extend(t for t in drawn if t not in offerable)
    if chosen or not offerable:
        return chosen
    # max() keeps the first of equal maxima, so ties go to the earliest toolset.
    return [max(offerable, key=probabilities.__getitem__)]


def format_distributions(toolsets: dict[str, list[str]] | None = None) -> str:
    """A readable listing of every distribution for `--list_distributions`.

    ``toolsets``: toolset -> lines describing it (where it comes from, its tools), listed after the
    distributions under "Toolsets:"."""
    lines: list[str] = []
    for dist in list_distributions().values():
        lines.append(f"{dist.name}: {dist.description}")
        # sorted() is stable: equal probabilities keep the distribution's own order.
        ranked = sorted(dist.probabilities.items(), key=lambda item: -item[1])
        width = max(len(toolset) for toolset, _ in ranked)
        lines.extend(f"  {toolset:<{width}}  {percent:>3}%" for toolset, percent in ranked)
        lines.append("")
    if toolsets:
        lines.append("Toolsets:")
        for name, about in toolsets.items():
            lines.append(f"  {name}: {about[0]}")
            lines.extend(f"    {line}" for line in about[1:])
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"
