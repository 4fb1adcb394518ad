"""Commit subjects of at most 72 characters: a subject is one line, the why goes in the body.

    python tools/commit_subjects.py               # check every commit after the rule began (make check runs it)
    python tools/commit_subjects.py --message F   # check one message file (the commit-msg hook: make hooks)

Commits before ``SINCE`` (when the rule began) are history and are not checked.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

LIMIT = 72
SINCE = "b29421d175f300cf54f23a262097e24c7a7a2bf8"  # the last commit before the rule


def too_long(subjects: list[tuple[str, str]]) -> list[str]:
    """``sha: subject (N characters)`` for each subject over the limit."""
    return [f"{sha[:9]}: {subject} ({len(subject)} characters)" for sha, subject in subjects if len(subject) > LIMIT]


def history() -> list[tuple[str, str]]:
    """(sha, subject) of every commit after ``SINCE``; none where git or that commit is not at hand."""
    done = subprocess.run(
        ["git", "log", "--format=%H %s", f"{SINCE}..HEAD"], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:  # a shallow clone without the commit the rule began at: nothing to check against
        print(f"commit subjects: {SINCE[:9]} is not in this clone's history; nothing checked", file=sys.stderr)
        return []
    return [tuple(line.split(" ", 1)) for line in done.stdout.splitlines() if " " in line]  # type: ignore[misc]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--message", type=Path, help="a commit message file (the commit-msg hook)")
    args = parser.parse_args()
    if args.message:
        lines = [line for line in args.message.read_text().splitlines() if line.strip() and not line.startswith("#")]
        subjects = [("new", lines[0].rstrip())] if lines else []
    else:
        subjects = history()
    found = too_long(subjects)
    for line in found:
        print(f"subject over {LIMIT} characters: {line}", file=sys.stderr)
    if found:
        print("a subject is one line of at most 72 characters; the why goes in the body", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
