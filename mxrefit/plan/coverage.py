"""Does a set of writers cover a range exactly once? One sweep, shared by every such rule.

Why one place: a parameter's bytes (every byte written by one target) and a shared region's
rows (every row written by one trainer tensor) obey the same rule; each caller words the
problems in its own units.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class CoverProblem:
    """``[start, end)`` is written twice ("overlap": by ``earlier`` and ``writer``), by nobody
    ("gap": before ``writer``; "tail": after ``earlier``, to the end), or lies past the end
    ("past": ``earlier`` writes up to ``end``)."""

    kind: Literal["overlap", "gap", "tail", "past"]
    start: int
    end: int
    earlier: str
    writer: str = ""


def cover_problems(writes: Iterable[tuple[int, int, str]], total: int) -> Iterator[CoverProblem]:
    """The problems of ``[start, end, writer)`` intervals covering ``[0, total)``, in order."""
    pos, last = 0, ""
    for start, end, writer in sorted(writes):
        if start < pos:
            yield CoverProblem("overlap", start, min(end, pos), last, writer)
        elif start > pos:
            yield CoverProblem("gap", pos, start, last, writer)
        if end > pos:
            pos, last = end, writer
    if pos < total:
        yield CoverProblem("tail", pos, total, last)
    elif pos > total:
        yield CoverProblem("past", total, pos, last)
