"""Config problems: collected while loading, raised together as one `ConfigError`.

A person reads these, so each names the file, the stage, the field, and what to do.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a config file."""

    file: str
    stage_id: int | None
    field: str
    message: str
    unread: bool = False
    """A key a stage with its own engine does not read (`config migrate` drops these)."""

    def format(self) -> str:
        """`error: FILE: stage N: field: message` (the CLI's line format)."""
        where = [self.file]
        if self.stage_id is not None:
            where.append(f"stage {self.stage_id}")
        if self.field:
            where.append(self.field)
        return "error: " + ": ".join(where) + ": " + self.message


class ConfigError(Exception):
    """A config that cannot be loaded; `.problems` lists every problem found."""

    def __init__(self, problems: list[ConfigProblem]):
        self.problems = list(problems)
        super().__init__("\n".join(p.format() for p in self.problems))


class ProblemSink:
    """Collects problems for one file so that loading can report them all at once."""

    def __init__(self, file: str):
        self.file = file
        self.problems: list[ConfigProblem] = []

    def add(self, stage_id: int | None, field: str, message: str, unread: bool = False) -> None:
        problem = ConfigProblem(self.file, stage_id, field, message, unread)
        if problem not in self.problems:
            self.problems.append(problem)

    def raise_if_any(self) -> None:
        if self.problems:
            raise ConfigError(self.problems)


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """` (did you mean 'x'?)` for the closest candidate, or '' when none is close."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.75)
    return f" (did you mean '{matches[0]}'?)" if matches else ""
