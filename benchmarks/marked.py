"""The blocks of the files `make bench` rewrites that are found by their HTML comment markers."""
from __future__ import annotations

from pathlib import Path

KEPT = ("<!-- kept:start -->", "<!-- kept:end -->")                  # RESULTS.md: the hand-written sessions
README_TABLE = ("<!-- benchmarks:start -->", "<!-- benchmarks:end -->")   # README.md: the headline table


def split(text: str, markers: tuple[str, str]) -> tuple[str, str, str] | None:
    """(before, inside, after) the block between the markers, or None where the text lacks either."""
    start, end = markers
    if start not in text or end not in text:
        return None
    head, rest = text.split(start, 1)
    inside, tail = rest.split(end, 1)
    return head, inside, tail


def kept(text: str) -> str:
    """A RESULTS.md's hand-written findings (the dated sessions, which no JSON holds), markers included, for the
    regenerated file to carry over; "" where there is none."""
    parts = split(text, KEPT)
    return "" if parts is None else f"{KEPT[0]}{parts[1]}{KEPT[1]}"


def replace(path: Path, markers: tuple[str, str], body: str) -> None:
    """The block between the markers of `path` replaced by body (the file left alone where it lacks them)."""
    parts = split(path.read_text(), markers)
    if parts is not None:
        path.write_text(f"{parts[0]}{markers[0]}\n{body}\n{markers[1]}{parts[2]}")
