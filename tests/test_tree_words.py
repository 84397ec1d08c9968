"""The tree speaks of the project, not of when it was written: no tracked file's path or text names
a period of work, a run id or an issue number.

Every tracked file (``git ls-files``; binary files are skipped, their paths are still checked) is
searched, case-insensitively, for a period of work ("session" and a number), a run id (``s`` digits
``r`` digits, e.g. the id of the third run of the seventh period, or ``r`` digits and a letter),
an issue number ("issue" and a
number, with or without ``#``) and "round" and a number. Ordinary words stay: pytest's
``scope="session"``, "a round trip", "issue" without a number. A hit fails the test with
file:line of each. The patterns are built from pieces so that this file does not match them.
"""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_D = r"\d"  # the patterns are assembled, so this file's own text never spells one of them
PATTERNS = {
    "period of work": re.compile("sess" + "ion ?" + _D + "|sess" + "ion" + _D, re.IGNORECASE),
    "run id": re.compile(r"\b" + "s" + _D + "+" + "r" + _D + r"+\b", re.IGNORECASE),
    # the short form, a run within a period ("r" digits and a letter: the first run of the fifth)
    "short run id": re.compile(r"\b" + "r" + _D + "+" + r"[a-z]\b", re.IGNORECASE),
    "issue number": re.compile("iss" + "ue ?#?" + _D + "+", re.IGNORECASE),
    "round number": re.compile("rou" + "nd " + _D, re.IGNORECASE),
}


def hits(name, text):
    """``[(kind, line_no, line)]`` of every pattern hit in ``text`` (line 0: the path itself)."""
    out = [(kind, 0, name) for kind, rx in PATTERNS.items() if rx.search(name)]
    for no, line in enumerate(text.splitlines(), 1):
        out += [(kind, no, line.strip()[:120]) for kind, rx in PATTERNS.items() if rx.search(line)]
    return out


def test_the_patterns_find_history_words_and_leave_ordinary_words():
    assert hits("x", "see sess" + "ion 12 and Sess" + "ion3") and hits("x", "as run " + "s7" + "r3 showed")
    assert hits("x", "fixes iss" + "ue #24") and hits("x", "Iss" + "ue 9") and hits("x", "the rou" + "nd 2 grid")
    assert hits("notes/sess" + "ion2.md", "") and hits("x", "(S12" + "R4)") and hits("x", "(run " + "r5" + "a)")
    ordinary = ('@pytest.fixture(scope="session")', "a round trip", "an issue with NaN", "rounds 3",
                "issues show", "sessions", "the s1 setting, r2 rows", "ds1r2x", "round-off", "regression 1",
                "r2 = 0.99", "Hopper's r2a4")
    for text in ordinary:
        assert not hits("x", text), text


def test_no_history_words_in_tracked_files():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("git or the repository's .git is unavailable (CI has both)")
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    found = []
    for rel in filter(None, files.decode().split("\0")):
        path = ROOT / rel
        data = path.read_bytes() if path.is_file() else b""
        text = "" if b"\0" in data[:8192] else data.decode("utf-8", errors="replace")  # binary: the path only
        found += [f"{rel}:{no}: {kind}: {line}" for kind, no, line in hits(rel, text)]
    assert not found, f"{len(found)} history word(s) in the tree:\n" + "\n".join(found[:200])
