"""Every benchmark result a tracked file cites exists, and every results folder says what it holds.

A citation is any ``bench/results/...`` path in a tracked text file (docs, design rationale, code
comments, candidate lists, tests). Results are filed as ``bench/results/<YYYY-MM-DD>_<gpu>_<commit>/``
with an ``env.json`` (GPU, driver, torch, triton, the commit measured, the command, each file's
run status), so a result that moves or is deleted without its citations being updated fails here.

The same holds for the suite's own files: every other ``bench/...`` path (``.py``, ``.sh``,
``.json``, ``.txt``, ``.csv``, ``.md``) a tracked file names is a tracked file of this tree, unless
it is written as ``git show <sha>:bench/...`` (a script removed from the suite, cited at the
commit that still has it): then the path must exist at that commit (``git cat-file -e``, where
this clone has the commit). A run's own record under ``bench/results/`` names the scripts as they
were when it ran, so it is not scanned for these.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
# a path up to whitespace, a quote, a backtick, a bracket or a comma (commas inside {a,b} belong to it)
CITATION = re.compile(r"bench/results/(?:\{[^{}\s]*\}|[^\s`'\"()\[\],;|{}])*")
FOLDER = re.compile(r"^\d{4}-\d{2}-\d{2}_[a-z0-9-]+_([0-9a-f]{7,40}|unknown)$")
STATUSES = {"ok", "cut short", "crashed", "failed"}
# a suite path: bench/ not inside a longer path (streamkl_bench/perf.py, .legacy/x/bench/...),
# optionally after ./ and after "git show <sha>:" (a space or a line break between the words)
BENCH_PATH = re.compile(r"(?:git\s+show\s+([0-9a-f]{7,40}):)?(?<![\w./-])(?:\./)?"
                        r"(bench/[\w./-]*?\.(?:py|sh|json|txt|csv|md))(?![\w.-]*\w)")


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


def bench_paths(text: str) -> list[tuple[int, str, str | None]]:
    """``[(line_no, path, sha)]`` of every ``bench/...`` path in ``text`` outside ``bench/results/``
    (``sha``: the commit of a ``git show <sha>:path`` citation, else None)."""
    found = []
    for m in BENCH_PATH.finditer(text):
        if not m.group(2).startswith("bench/results/"):
            found.append((text.count("\n", 0, m.start(2)) + 1, m.group(2), m.group(1)))
    return found


def bench_citations() -> list[tuple[str, int, str, str | None]]:
    found = []
    for rel in _tracked_text_files():
        if rel == "tests/test_results_citations.py" or rel.startswith("bench/results/"):
            continue
        with open(os.path.join(ROOT, rel), encoding="utf-8", errors="replace") as fh:
            found += [(rel, no, path, sha) for no, path, sha in bench_paths(fh.read())]
    return found


def _tracked() -> set[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return {p for p in out.decode().split("\0") if p}


def _git_has(sha: str, path: str | None = None) -> bool:
    """Whether this clone has commit ``sha`` (with ``path``: and that path exists at it)."""
    obj = f"{sha}^{{commit}}" if path is None else f"{sha}:{path}"
    return subprocess.run(["git", "cat-file", "-e", obj], cwd=ROOT, capture_output=True).returncode == 0


def test_bench_path_scan_reads_citations_as_written():
    text = ("run `python bench/bench_gpu.py --sections nan`\n"
            "see streamkl_bench/perf.py, .legacy/fec3a94/bench/bench_gpu.py, bench/results/x/env.json\n"
            "measured by ``git show b7066de:bench/bwd_gpu.py`` (and ./bench/plot.py)\n"
            "the removed script, ``git show\nb7066de:bench/gluon_gpu.py``; bare b7066de:bench/nan_check.py\n"
            "bench/profile/ncu_run.sh, bench/README.md. bench/x.pyc bench/a.py.bak")
    assert bench_paths(text) == [(1, "bench/bench_gpu.py", None), (3, "bench/bwd_gpu.py", "b7066de"),
                                 (3, "bench/plot.py", None), (5, "bench/gluon_gpu.py", "b7066de"),
                                 (5, "bench/nan_check.py", None), (6, "bench/profile/ncu_run.sh", None),
                                 (6, "bench/README.md", None)]


def test_bench_citations_are_found():
    """The scan sees the suite paths this repository is known to cite (so an empty scan cannot pass)."""
    cited = {(path, sha is not None) for _, _, path, sha in bench_citations()}
    assert ("bench/bench_gpu.py", False) in cited and any(at for _, at in cited), sorted(cited)[:20]


def test_every_cited_bench_file_exists():
    """A ``bench/...`` path a tracked file names is a tracked file (a script that was removed is
    cited as ``git show <sha>:bench/NAME``, not by a path this tree no longer has)."""
    tracked = _tracked()
    missing = [f"{rel}:{no}: {path}" for rel, no, path, sha in bench_citations()
               if sha is None and path not in tracked]
    assert not missing, ("cited bench files that are not in the tree (cite the results folder, the "
                         "suite section, or git show <sha>:path):\n" + "\n".join(missing))


def test_every_git_show_citation_names_a_file_at_its_commit():
    """``git show <sha>:bench/NAME`` citations name a file that exists at that commit."""
    if shutil.which("git") is None:
        pytest.skip("git unavailable")
    at_commit = [(rel, no, path, sha) for rel, no, path, sha in bench_citations() if sha is not None]
    here = [c for c in at_commit if _git_has(c[3])]
    if not here:
        pytest.skip(f"this clone has none of the cited commits {sorted({c[3] for c in at_commit})} (shallow?)")
    missing = [f"{rel}:{no}: git show {sha}:{path}" for rel, no, path, sha in here if not _git_has(sha, path)]
    assert not missing, "git show citations of paths that do not exist at that commit:\n" + "\n".join(missing)
