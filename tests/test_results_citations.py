"""Every benchmark result a tracked file cites exists, and every results folder says what it holds.

A citation is any ``bench/results/...`` path in a tracked text file (docs, design rationale, code
comments, candidate lists, tests). Results are filed as ``bench/results/<YYYY-MM-DD>_<gpu>_<commit>/``
with an ``env.json`` (GPU, driver, torch, triton, the commit measured, the command, each file's
run status), so a result that moves or is deleted without its citations being updated fails here.
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
# a path up to whitespace, a quote, a backtick, a bracket or a comma (commas inside {a,b} belong to it)
CITATION = re.compile(r"bench/results/(?:\{[^{}\s]*\}|[^\s`'\"()\[\],;|{}])*")
FOLDER = re.compile(r"^\d{4}-\d{2}-\d{2}_[a-z0-9-]+_([0-9a-f]{7,40}|unknown)$")
STATUSES = {"ok", "cut short", "crashed", "failed"}


def _tracked_text_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    paths = [p for p in out.decode().split("\0") if p]
    text = []
    for p in paths:
        full = os.path.join(ROOT, p)
        if not os.path.isfile(full) or os.path.getsize(full) > 2_000_000:
            continue
        with open(full, "rb") as fh:
            head = fh.read(4096)
        if b"\0" not in head:
            text.append(p)
    return text


def _expand_braces(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in _expand_braces(path[:m.start()] + alt + path[m.end():])]


def citations() -> list[tuple[str, int, str]]:
    found = []
    for rel in _tracked_text_files():
        if rel == "tests/test_results_citations.py":  # this file's patterns are not citations
            continue
        with open(os.path.join(ROOT, rel), encoding="utf-8", errors="replace") as fh:
            for lineno, line in enumerate(fh, 1):
                for m in CITATION.finditer(line):
                    found.append((rel, lineno, m.group(0).rstrip(".:")))
    return found


def _missing(path: str) -> bool:
    """Whether a cited path (a file, a folder, a glob or a template) names nothing that exists."""
    if re.search(r"[<$]|\{[^,{}]*\}", path):  # a template (<date>, $OUT, {folder}): its fixed folder must exist
        fixed = re.split(r"[<${]", path)[0]
        return not os.path.isdir(os.path.join(ROOT, os.path.dirname(fixed)))
    for p in _expand_braces(path):
        if "*" in p or "?" in p:
            head = p.split("*")[0].split("?")[0]
            folder = os.path.dirname(head)
            if not os.path.isdir(os.path.join(ROOT, folder)):
                return True
            # a glob inside one named results folder must match something; a pattern over all
            # folders (bench/results/*/...) is where a script looks and may match nothing yet
            if os.path.normpath(folder) != "bench/results" and not glob.glob(os.path.join(ROOT, p)):
                return True
        elif not os.path.exists(os.path.join(ROOT, p)):
            return True
    return False


def test_citations_are_found():
    """The scan sees the citations this repository is known to make (so an empty scan cannot pass)."""
    cited = {c for _, _, c in citations()}
    assert any(FOLDER.match(c.split("/")[2]) for c in cited if c.count("/") >= 3), sorted(cited)[:20]


def test_every_cited_result_exists():
    missing = [f"{rel}:{lineno}: {path}" for rel, lineno, path in citations() if _missing(path)]
    assert not missing, "cited results that do not exist:\n" + "\n".join(missing)


def _folders() -> list[str]:
    return sorted(d for d in os.listdir(RESULTS) if os.path.isdir(os.path.join(RESULTS, d)))


def test_results_are_filed_by_date_gpu_and_commit():
    bad = [d for d in _folders() if not FOLDER.match(d)]
    assert not bad, f"results folders not named <YYYY-MM-DD>_<gpu>_<commit>: {bad}"
    loose = [f for f in os.listdir(RESULTS) if os.path.isfile(os.path.join(RESULTS, f)) and f != "README.md"]
    assert not loose, f"results outside a dated folder: {loose}"


@pytest.mark.parametrize("folder", _folders())
def test_env_json_describes_every_file(folder):
    """env.json names the GPU, driver, torch, triton and commit, and gives each file a run status;
    no run status hides in a file name."""
    here = os.path.join(RESULTS, folder)
    with open(os.path.join(here, "env.json")) as fh:
        env = json.load(fh)
    for key in ("gpu", "driver", "torch", "triton", "commit"):
        assert env.get(key), f"{folder}/env.json: no {key}"
    assert env["commit"].startswith(folder.rsplit("_", 1)[1]), (folder, env["commit"])
    described = {}
    for r in env["runs"]:
        assert r.get("command"), f"{folder}/env.json: a run without its command ('not recorded' where unknown)"
        for name, info in r["files"].items():
            assert info["status"] in STATUSES, (folder, name, info["status"])
            described[name] = info["status"]
    files = {f for f in os.listdir(here) if f != "env.json"}
    assert files == set(described), (folder, sorted(files ^ set(described)))
    for name in files:
        assert not re.search(r"cut_short|partial|crashed|failed|_final_", name), (folder, name)
        if name.endswith(".csv"):
            with open(os.path.join(here, name), newline="") as fh:
                header = fh.readline().strip().split(",")
            assert "run_status" in header, f"{folder}/{name}: no run_status column"
