"""The documentation site: generated pieces up to date, and a strict build that succeeds.

- docs/_generated/trace_example.md must be byte-equal to what docs/gen_trace_example.py writes
  now (it is generated from `streamkl trace --json`; regenerate with
  `.venv/bin/python docs/gen_trace_example.py` and commit).
- `mkdocs build --strict` must succeed from the repository root into a temporary directory, with
  the proof pages (added by docs/hooks.py) and the worked example in the output, and every
  `$$ ... $$` block turned into MathJax markup.
"""
import glob
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
SNIPPET = os.path.join(DOCS, "_generated", "trace_example.md")


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_trace_snippet_is_up_to_date(tmp_path):
    out = tmp_path / "trace_example.md"
    proc = subprocess.run([sys.executable, os.path.join(DOCS, "gen_trace_example.py"), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fresh = out.read_bytes()
    with open(SNIPPET, "rb") as fh:
        committed = fh.read()
    assert fresh == committed, (
        "docs/_generated/trace_example.md is stale: run `.venv/bin/python docs/gen_trace_example.py` and commit it")


def test_trace_snippet_numbers_come_from_streamkl_trace():
    """The KL the page shows is the one `streamkl trace --json` reports (not typed in)."""
    gen = _load("gen_trace_example", os.path.join(DOCS, "gen_trace_example.py"))
    trace = gen.run_trace(gen.MAIN_ARGS)
    row = trace["rows"][0]
    with open(SNIPPET, encoding="utf-8") as fh:
        text = fh.read()
    assert gen.f(row["kl_online"], 17) in text
    assert row["kl_mp_digits"] in text
    # the finalisation the page does by hand agrees with the trace's own KL
    last = row["tiles"][-1]
    kl = last["acc"] / last["l1"] + (last["m2"] + math.log(last["l2"])) - (last["m1"] + math.log(last["l1"]))
    assert abs(kl - row["kl_online"]) <= 1e-14 * max(1.0, abs(kl))
    assert f"= {gen.f(kl)}." in text


def test_plots_marker_lists_existing_pngs(tmp_path, monkeypatch):
    hooks = _load("streamkl_docs_hooks", os.path.join(DOCS, "hooks.py"))
    monkeypatch.setattr(hooks, "ASSETS", str(tmp_path))
    assert "No benchmark plots yet" in hooks.plots_markdown()
    (tmp_path / "decode.png").write_bytes(b"")
    (tmp_path / "fwd_time.png").write_bytes(b"")
    md = hooks.plots_markdown()
    assert "No benchmark plots yet" not in md
    assert md.index("assets/fwd_time.png") < md.index("assets/decode.png")  # plot.py's order


def test_mkdocs_build_strict(tmp_path):
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    pages = ["index.html", "tutorial/index.html", "api/index.html", "verify/index.html",
             "performance/index.html", "proofs/index.html", "indexer/index.html"]
    proofs = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(ROOT, "proofs", "0*.md")))
    assert len(proofs) == 9  # statements 1-9
    with open(os.path.join(ROOT, "mkdocs.yml")) as fh:
        nav = fh.read()
    for name in proofs:  # every statement is in the site's navigation
        assert f"proofs/{name}.md" in nav, name
    pages += [f"proofs/{name}/index.html" for name in proofs]
    for page in pages:
        assert (site / page).is_file(), f"{page} missing from the site"
    # build helpers are not published
    assert not (site / "hooks.py").exists() and not (site / "gen_trace_example.py").exists()

    tutorial = (site / "tutorial" / "index.html").read_text(encoding="utf-8")
    assert "--8&lt;--" not in tutorial and "--8<--" not in tutorial, "the snippet was not included"
    with open(SNIPPET, encoding="utf-8") as fh:
        first_row = next(line for line in fh if line.startswith("| KL (nats) |"))
    kl_shown = first_row.split("|")[2].strip()
    assert kl_shown in tutorial

    performance = (site / "performance" / "index.html").read_text(encoding="utf-8")
    assert "streamkl:plots" not in performance
    pngs = sorted(os.path.basename(p) for p in glob.glob(os.path.join(DOCS, "assets", "*.png")))
    if pngs:
        for name in pngs:
            assert f"assets/{name}" in performance
            assert (site / "assets" / name).is_file()
    else:
        assert "No benchmark plots yet" in performance

    # math: every display block became MathJax markup; no raw $ left in the prose
    for page in pages:
        html = (site / page).read_text(encoding="utf-8")
        body = re.sub(r"<pre.*?</pre>|<code.*?</code>|<script.*?</script>", "", html, flags=re.S)
        body = body[body.find("<article"):body.find("</article>")]
        assert "$" not in body, f"unrendered math in {page}: {body[body.find('$') - 80:body.find('$') + 80]!r}"
    assert 'class="arithmatex"' in tutorial
    # the search index knows the proof pages (they are real pages, not static files)
    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    assert any(doc["location"].startswith("proofs/02_online_update/") for doc in index["docs"])
