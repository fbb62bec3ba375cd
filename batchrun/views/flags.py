"""What every view's command line shares: its parser, and the rule for a re-scoring's name.

Each ``python -m batchrun.views.*`` builds its parser with :class:`ViewParser`, which reads flags as
strictly as the runner does (``batchrun.config.parse_argv``): a flag is named in full (argparse's
abbreviations read ``--boot=200`` as ``--bootstrap`` and ``--min=0.5`` as ``--min_score``), and given once
(the last of two silently won). Either mistake exits 2 naming the flag, before any work.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any

# The name of a re-scoring (scores.NAME.jsonl), as views.score --name takes it and views.compare --scores
# reads it: it goes into a file name in the run directory, so no path separator, and never empty.
SCORES_NAME = re.compile(r"[\w.+-]+")


def scores_name_problem(flag: str, name: str) -> str | None:
    """Why ``name`` is no re-scoring's name (a message naming ``flag``), or None when it is one."""
    if SCORES_NAME.fullmatch(name):
        return None
    shown = "empty" if not name else f"{name!r}"
    return f"{flag}: letters, digits, '.', '+', '-' and '_' only (a re-scoring's NAME, as scores.NAME.jsonl), got {shown}"


class ViewParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that takes no abbreviated flag and refuses a flag given twice (exit 2)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._refuse_repeats(list(args) if args is not None else None)
        return super().parse_known_args(args, namespace)

    def _refuse_repeats(self, args: list[str] | None) -> None:
        """Exit 2 on a flag given twice, in any of its spellings (``--max_trajectories`` and
        ``--max-trajectories``; ``--x`` and ``--no-x``), with or without ``=``."""
        seen: dict[int, str] = {}
        for token in sys.argv[1:] if args is None else args:
            if token == "--":  # what follows is positional
                break
            if not token.startswith("--"):
                continue
            name = token.partition("=")[0]
            action = self._option_string_actions.get(name)
            if action is None:  # unknown or abbreviated: argparse says so
                continue
            first = seen.get(id(action))
            if first is None:
                seen[id(action)] = name
                continue
            also = "" if first == name else f" (as {first} and {name})"
            self.error(f"{name} is given more than once{also}; give it once")
