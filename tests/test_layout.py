"""The layout of the packages holds what docs/architecture.md says: no import cycle in streamkl_gpu/
or streamkl_ref/, ``streamkl_gpu._core`` imports no kernel module, no library file over 800
lines, ``__init__.py`` files that only re-export, one table of environment variables that matches
the code and docs/api.md, and a map of the house whose every path exists."""
from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("streamkl_gpu", "streamkl_ref")
MAX_LINES = 800


def _modules(package):
    """module name -> path for every .py file of ``package``."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = {name: path for p in PACKAGES for name, path in _modules(p).items()}


def _imports(name, path):
    """The project modules ``name`` imports anywhere in its file (function-level imports count:
    they close a cycle as surely as top-level ones)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # "streamkl_gpu.x.y" where y is a name in module x
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycle():
    """One import cycle as a list of modules, or None."""
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(GRAPH[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(GRAPH):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = _cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_graph_sees_imports():
    """The checker is not vacuous: it finds the edges it must (relative and absolute, in functions)."""
    assert "streamkl_gpu._core.runtime" in GRAPH["streamkl_gpu.attention.launch"]
    assert "streamkl_gpu.attention.triton.fwd" in GRAPH["streamkl_gpu.attention.launch"]
    assert "streamkl_gpu._core.runtime" in GRAPH["streamkl_gpu.distributed"]  # a function-level import
    assert any(m.startswith("streamkl_ref.") for m in GRAPH["streamkl_ref"])  # relative imports


def test_core_imports_no_kernel_module():
    """``_core`` (runtime, checks, tuner, launcher, env, forcing, shared jit helpers) depends on
    nothing else of streamkl_gpu: importing it defines no kernel."""
    for name, deps in GRAPH.items():
        if name.startswith("streamkl_gpu._core"):
            outside = sorted(d for d in deps if d.startswith("streamkl_gpu") and not d.startswith("streamkl_gpu._core"))
            assert not outside, f"{name} imports {outside}"


def test_no_library_file_over_800_lines():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "streamkl_gpu").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_bench_stays_a_small_suite():
    """bench/ holds at most 5,000 lines of Python (the suite, not a second library)."""
    lines = sum(len(p.read_text().splitlines()) for p in (ROOT / "bench").rglob("*.py"))
    assert lines <= 5000, f"bench/ has {lines} lines of Python"


def test_init_files_only_re_export():
    """Every ``__init__.py`` of streamkl_gpu holds a docstring, imports, ``__all__`` and (the top
    package) the lazy lookup of its public names: no code of its own."""
    for path in (ROOT / "streamkl_gpu").rglob("__init__.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            ok = (isinstance(node, (ast.Import, ast.ImportFrom))
                  or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
                  or (isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id in ("__all__", "_HOMES")
                                                           for t in node.targets))
                  or (isinstance(node, ast.FunctionDef) and node.name in ("__getattr__", "__dir__")
                      and path.parent.name == "streamkl_gpu"))
            assert ok, f"{path.relative_to(ROOT)}:{node.lineno}: {type(node).__name__} in an __init__.py"


# ----------------------------------------------------------------------------------------------
# Environment variables: one list in the code, one table in docs/api.md
# ----------------------------------------------------------------------------------------------

def _doc_tables():
    """(current variables, old variables) named in docs/api.md's environment-variable tables."""
    text = (ROOT / "docs" / "api.md").read_text()
    section = text[text.index("## Environment variables"):]
    section = section[:section.index("\n## ", 3)]
    current, old = set(), set()
    table = None
    for line in section.splitlines():
        if line.startswith("| variable |"):
            table = current
        elif line.startswith("| old variable |"):
            table = old
        elif line.startswith("| `") and table is not None:
            table.add(line.split("`")[1])
        elif not line.startswith("|"):
            table = None if line.strip() else table
    return current, old


def test_env_table_matches_the_code():
    from streamkl_gpu._core import env

    current, old = _doc_tables()
    assert current == set(env.VARIABLES), (current ^ set(env.VARIABLES))
    assert old == set(env.DEPRECATED)
    assert set(env.DEPRECATED.values()) <= set(env.VARIABLES)


def test_every_variable_the_library_reads_is_listed():
    from streamkl_gpu._core import env

    known = set(env.VARIABLES) | set(env.DEPRECATED)
    seen = set()
    for path in (ROOT / "streamkl_gpu").rglob("*.py"):
        seen |= set(re.findall(r"\b(STREAMKL_[A-Z0-9_]+[A-Z0-9])\b", path.read_text()))
    assert seen - known == set(), f"read but not listed: {sorted(seen - known)}"
    assert known - seen == set(), f"listed but never read: {sorted(known - seen)}"


def test_training_design_words_and_old_names(monkeypatch):
    """STREAMKL_INDEXER_TRAINING's words pick the designs; the old pair still works (warning once,
    naming the replacement) and means what it meant; a bad word names its variable."""
    import streamkl_ref
    from streamkl_gpu._core import env
    from streamkl_gpu.indexer.training import choice

    rng = __import__("numpy").random.default_rng(0)
    mqa = streamkl_ref._checks.check_indexer_inputs(*(rng.standard_normal(s) for s in
                                                      ((1, 2, 5, 8), (1, 1, 7, 8), (1, 2, 5, 4), (1, 1, 7, 4), (1, 2, 5))))
    gqa = streamkl_ref._checks.check_indexer_inputs(*(rng.standard_normal(s) for s in
                                                      ((1, 4, 5, 8), (1, 2, 7, 8), (1, 2, 5, 4), (1, 1, 7, 4), (1, 2, 5))))
    for var in ("STREAMKL_INDEXER_TRAINING", "STREAMKL_INDEXER_PACC", "STREAMKL_INDEXER_PSTORE"):
        monkeypatch.delenv(var, raising=False)
    assert choice.training_design(mqa) == "chunk" == choice.training_design(gqa)  # auto: chunk for every teacher
    for word in ("plain", "accumulate", "store", "chunk"):
        monkeypatch.setenv("STREAMKL_INDEXER_TRAINING", word)
        assert choice.training_design(mqa) == word == choice.training_design(gqa)
    monkeypatch.setenv("STREAMKL_INDEXER_TRAINING", "pstore")
    with pytest.raises(ValueError, match="STREAMKL_INDEXER_TRAINING"):
        choice.training_design(mqa)
    monkeypatch.delenv("STREAMKL_INDEXER_TRAINING")
    monkeypatch.setattr(env, "_WARNED", set())
    monkeypatch.setenv("STREAMKL_INDEXER_PSTORE", "1")
    with pytest.warns(FutureWarning, match="STREAMKL_INDEXER_PSTORE is deprecated: use STREAMKL_INDEXER_TRAINING"):
        assert choice.training_design(mqa) == "store"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: no second warning
        assert choice.training_design(gqa) == "store"
    monkeypatch.setenv("STREAMKL_INDEXER_PACC", "0")
    with pytest.warns(FutureWarning, match="STREAMKL_INDEXER_PACC"):
        assert choice.training_design(mqa) == "plain"
    monkeypatch.setenv("STREAMKL_INDEXER_TRAINING", "accumulate")  # the new name wins
    assert choice.training_design(mqa) == "accumulate"


def test_indexer_backend_words_and_old_names(monkeypatch):
    from streamkl_gpu._core import env
    from streamkl_gpu.indexer import host

    for var in ("STREAMKL_INDEXER_BACKEND", "STREAMKL_INDEXER_GLUON", "STREAMKL_INDEXER_GLUON_PACC"):
        monkeypatch.delenv(var, raising=False)
    # auto: the plain forward's Gluon kernel in the measured family, the accumulating one's never
    assert (host.gluon_mode(), host.gluon_mode(pacc=True)) == ("auto", "0")
    monkeypatch.setenv("STREAMKL_INDEXER_BACKEND", "triton")
    assert host.gluon_mode() == host.gluon_mode(pacc=True) == "0"
    monkeypatch.setenv("STREAMKL_INDEXER_BACKEND", "gluon")
    assert host.gluon_mode() == host.gluon_mode(pacc=True) == "1"
    monkeypatch.setenv("STREAMKL_INDEXER_BACKEND", "cuda")
    with pytest.raises(ValueError, match="STREAMKL_INDEXER_BACKEND"):
        host.gluon_mode()
    monkeypatch.delenv("STREAMKL_INDEXER_BACKEND")
    monkeypatch.setattr(env, "_WARNED", set())
    monkeypatch.setenv("STREAMKL_INDEXER_GLUON_PACC", "1")
    with pytest.warns(FutureWarning, match="use STREAMKL_INDEXER_BACKEND"):
        assert host.gluon_mode(pacc=True) == "1"
    assert host.gluon_mode() == "auto"  # the old names were per forward (the plain one: its default)


def test_forcing_hook_validates_and_nests():
    from streamkl_gpu._core import forcing

    with pytest.raises(ValueError, match="forcing"):
        with forcing.forcing(attention_fwd_varaint="no_exp"):
            pass
    assert forcing.forced("attention_fwd_variant") is None
    with forcing.forcing(attention_fwd_variant="no_exp") as outer:
        with forcing.forcing(attention_fwd_variant="no_acc") as inner:
            assert forcing.forced("attention_fwd_variant") == "no_acc"
            forcing.record("k", "compiled", SCHED=3)
        assert forcing.forced("attention_fwd_variant") == "no_exp"
    assert forcing.forced("attention_fwd_variant") is None
    assert outer.last("k").meta == {"SCHED": 3} and inner.last("k").kernel == "compiled"
    with pytest.raises(LookupError):
        outer.last("other")
    forcing.record("k", "ignored")  # no block open: nothing is kept
    assert len(outer.launches) == 1


# ----------------------------------------------------------------------------------------------
# The map of the house
# ----------------------------------------------------------------------------------------------

def _architecture_paths():
    text = (ROOT / "docs" / "architecture.md").read_text()
    now, was = set(), set()
    for cell in re.findall(r"`([^`\s]+)`", text):
        if re.match(r"^(streamkl_gpu|streamkl_ref|tests|proofs|bench|docs|examples)/", cell):
            now.add(cell.split("::")[0])
    for note in re.findall(r"\(was: ([^)]*)\)", text):  # "(was: `old/path.py`, part of `other.py`)"
        was.update(re.findall(r"`([^`]+)`", note))
    return now - was, was


def test_every_path_in_the_map_exists():
    now, was = _architecture_paths()
    assert len(now) > 30 and len(was) >= 24
    missing = sorted(p for p in now if not (ROOT / p.rstrip("/")).exists())
    assert not missing, missing
    gone = sorted(p for p in was if (ROOT / p).exists())
    assert not gone, f"'was:' paths that still exist: {gone}"


def test_the_map_covers_every_library_file():
    now, _ = _architecture_paths()
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "streamkl_gpu").rglob("*.py") if p.name != "__init__.py"}
    assert files - now == set(), sorted(files - now)


def test_every_kernel_atomic_add_is_relaxed():
    """Every ``tl.atomic_add`` in the kernels accumulates a sum read only after its kernel, so it
    passes ``sem="relaxed"``: Triton's default (acq_rel) puts a full GPU memory fence before each
    atomic in the SASS (a chain of L2 round trips per tile)."""
    missing, found = [], 0
    for path in sorted((ROOT / "streamkl_gpu").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "atomic_add"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "tl"):
                found += 1
                sem = [k.value for k in node.keywords if k.arg == "sem"]
                if not (sem and isinstance(sem[0], ast.Constant) and sem[0].value == "relaxed"):
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found >= 7 and not missing, (found, missing)
