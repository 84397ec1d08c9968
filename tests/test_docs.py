"""The documentation site: generated pieces up to date, and a strict build that succeeds.

- docs/_generated/trace_example.md must be byte-equal to what docs/gen_trace_example.py writes
  now (it is generated from `streamkl trace --json`; regenerate with
  `.venv/bin/python docs/gen_trace_example.py` and commit), and
  docs/_generated/performance_tables.md to what docs/gen_performance.py makes of bench/results/.
- `mkdocs build --strict` must succeed from the repository root into a temporary directory, with
  the proof pages (added by docs/hooks.py) and the worked example in the output, and every
  `$$ ... $$` block turned into MathJax markup.
- The built pages load nothing from another host: no script, stylesheet, icon, font or image
  whose address is on another host, in any page's HTML or in any stylesheet the site ships
  (`url(...)`, `@import`); every local one exists in the site, MathJax and its fonts included.
  Links (`<a href>`) to other sites are fine.
- The README, the docs, the proofs and the packages' docstrings refer to nothing outside the
  repository (the math contract is docs/math.md), and a number of proof statements written
  in words is the real one. (docs/check_browser.py renders the pages in a real
  Chromium with every other host unreachable; it needs a browser, so it is not part of CI.)
"""
import glob
import html.parser
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import urllib.parse

import pytest

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


def test_performance_tables_are_up_to_date(tmp_path):
    """docs/_generated/performance_tables.md is what docs/gen_performance.py makes of the committed
    results now: a result re-filed or added without regenerating the page fails here."""
    out = tmp_path / "performance_tables.md"
    proc = subprocess.run([sys.executable, os.path.join(DOCS, "gen_performance.py"), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(os.path.join(DOCS, "_generated", "performance_tables.md"), "rb") as fh:
        committed = fh.read()
    assert out.read_bytes() == committed, (
        "docs/_generated/performance_tables.md is stale: run `python docs/gen_performance.py` and commit it")


def test_performance_tables_match_their_csv():
    """A number the page shows is the CSV's: the 8K non-causal forward ratio and the DSA-like
    training step, read from the results the page names."""
    import csv
    gen = _load("gen_performance", os.path.join(DOCS, "gen_performance.py"))
    path = gen.newest_attention("fwd")[0]
    with open(os.path.join(DOCS, "_generated", "performance_tables.md"), encoding="utf-8") as fh:
        page = fh.read()
    assert os.path.relpath(path, ROOT).replace(os.sep, "/") in page
    with open(path, newline="") as fh:
        row = next(r for r in csv.DictReader(fh) if (r["operation"], r["pass"], r["n_q"], r["causal"], r["baseline"])
                   == ("attention_kl", "fwd", "8192", "0", "sdpa_fwd"))
    section = page.split("### attention_kl: forward\n", 1)[1].split("###", 1)[0]
    line = next(l for l in section.splitlines() if l.startswith("| 8K |"))
    assert line.split("|")[2].strip() == row["value"] + "×"
    with open(gen.newest("indexer.csv"), newline="") as fh:
        step = next(r for r in csv.DictReader(fh) if (r["teacher"], r["lse_given"], r["pass"], r["provider"])
                    == ("dsa", "1", "fwd_bwd", "ours"))
    assert f"training step: {gen.fmt(float(step['ms']))} ms" in page


def test_readme_speed_block_is_generated():
    """The README's speed block is what docs/gen_performance.py makes of the committed results, and
    its table shows the forward ratios of the attention.csv it names, as written there."""
    import csv
    gen = _load("gen_performance", os.path.join(DOCS, "gen_performance.py"))
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    assert gen.splice_readme(readme) == readme, (
        "the README's speed block is stale: run `python docs/gen_performance.py` and commit it")
    block = readme[readme.index(gen.README_BEGIN):readme.index(gen.README_END)]
    cited = re.search(r"`(bench/results/[^`]+/attention\.csv)`", block).group(1)
    with open(os.path.join(ROOT, cited), newline="") as fh:
        rs = [r for r in csv.DictReader(fh) if gen.ATTENTION_KINDS["fwd"](r) and r["n_q"] == "8192"]
    head = next(l for l in block.splitlines() if l.startswith("| attention_kl, time / SDPA's"))
    col = [c.strip() for c in head.strip("|").split("|")].index("8K")
    for causal, label in (("0", "forward, non-causal"), ("1", "forward, causal")):
        line = next(l for l in block.splitlines() if l.startswith(f"| {label} |"))
        row = next(r for r in rs if r["causal"] == causal)
        assert [c.strip() for c in line.strip("|").split("|")][col] == row["value"] + "×", (label, line)


def test_readme_speed_block_is_spliced_between_its_markers():
    gen = _load("gen_performance", os.path.join(DOCS, "gen_performance.py"))
    text = f"intro\n{gen.README_BEGIN}\nold figures\n{gen.README_END}\nafter\n"
    out = gen.splice_readme(text)
    assert out.startswith("intro\n" + gen.README_BEGIN) and out.endswith(gen.README_END + "\nafter\n")
    assert "old figures" not in out and gen.splice_readme(out) == out
    with pytest.raises(SystemExit, match="no speed block"):
        gen.splice_readme("a README without the markers\n")


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


def test_plot_legends_name_providers_and_modes_in_words():
    """Every provider and mode bench/plot.py draws from a committed bench CSV has a label in
    words (LABELS, MODES): no raw column value such as ``ours_split1`` or ``fwd_bwd_s1`` in a
    legend or a title."""
    plot = _load("streamkl_bench_plot", os.path.join(ROOT, "bench", "plot.py"))
    files = glob.glob(os.path.join(ROOT, "bench", "results", "*", "bench*.csv"))
    assert files, "no committed bench CSV"
    providers, modes = set(), set()
    for f in files:
        _, rows = plot.load(os.path.dirname(f))
        for r in rows:
            if r["kernel"] == "env":  # the matmul rate and copy bandwidth rows: never drawn
                continue
            assert r["_prov"] != r["provider"] or " " in r["provider"], r["provider"]
            providers.add(r["_prov"])
            if r["kernel"] in ("fwd", "long"):  # peak_memory.png names the mode
                modes.add(plot.display_mode("fwd" if r["kernel"] == "fwd" else r["mode"]))
    assert plot.LABELS["ours_split1"] in providers
    for label in providers | modes:
        assert not re.search(r"\b(ours|sdpa|fwd_bwd)\w*_\w+", label), label


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once for this module by `mkdocs build --strict`."""
    site = tmp_path_factory.mktemp("docs") / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return site


def test_mkdocs_build_strict(site):
    pages = ["index.html", "tutorial/index.html", "math/index.html", "api/index.html", "verify/index.html",
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
    assert not list(site.rglob("*.py")), [str(p.relative_to(site)) for p in site.rglob("*.py")]

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


# --- nothing from another host ------------------------------------------------------------
# (tag, attribute) pairs whose address the browser loads by itself (not a link one clicks)
LOADS = {("script", "src"), ("link", "href"), ("img", "src"), ("img", "srcset"), ("source", "src"),
         ("source", "srcset"), ("iframe", "src"), ("embed", "src"), ("object", "data"), ("video", "src"),
         ("video", "poster"), ("audio", "src"), ("track", "src"), ("input", "src")}
CSS_URL = re.compile(r"""url\(\s*['"]?([^'")]+)['"]?\s*\)|@import\s+['"]([^'"]+)['"]""")


def is_external(url: str) -> bool:
    """An address on another host: with a scheme (http:, https:, ...) or protocol-relative;
    data: URIs and paths are local."""
    url = url.strip()
    if url.startswith("//"):
        return True
    scheme = urllib.parse.urlsplit(url).scheme
    return bool(scheme) and scheme != "data"


class _Loads(html.parser.HTMLParser):
    """Collects the addresses an HTML page loads: LOADS attributes, and url(...) in inline
    <style> blocks and style= attributes."""

    def __init__(self):
        super().__init__()
        self.urls: list[tuple[str, str]] = []  # (where, address)
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if value is None:
                continue
            if (tag, name) in LOADS:
                for part in (value.split(",") if name == "srcset" else [value]):
                    address = part.strip().split(" ")[0]
                    if address:
                        self.urls.append((f"<{tag} {name}>", address))
            if name == "style":
                self.urls += [(f"<{tag} style>", a or b) for a, b in CSS_URL.findall(value)]
        self._in_style = tag == "style"

    def handle_endtag(self, tag):
        if tag == "style":
            self._in_style = False

    def handle_data(self, data):
        if self._in_style:
            self.urls += [("<style>", a or b) for a, b in CSS_URL.findall(data)]


def page_loads(text: str) -> list[tuple[str, str]]:
    parser = _Loads()
    parser.feed(text)
    return parser.urls


def test_external_loads_are_detected():
    """The checker below can fail: each kind of external load is found, links and data: are not."""
    page = """<html><head>
      <link rel="stylesheet" href="https://fonts.example.org/css?family=Roboto">
      <link rel="preconnect" href="//fonts.example.org">
      <script src="https://cdn.example.org/mathjax.js"></script>
      <style>@font-face { font-family: X; src: url("https://cdn.example.org/x.woff2") }</style>
      </head><body>
      <img src="http://example.org/plot.png" srcset="a.png 1x, https://example.org/b.png 2x">
      <a href="https://example.org/">a link is fine</a><img src="data:image/png;base64,AAAA">
      <div style="background: url(https://example.org/bg.png)"></div><script src="local.js"></script>
      </body></html>"""
    external = sorted(u for _, u in page_loads(page) if is_external(u))
    assert external == sorted(["https://fonts.example.org/css?family=Roboto", "//fonts.example.org",
                               "https://cdn.example.org/mathjax.js", "https://cdn.example.org/x.woff2",
                               "http://example.org/plot.png", "https://example.org/b.png",
                               "https://example.org/bg.png"])
    assert ("<script src>", "local.js") in page_loads(page)
    assert not is_external("../assets/x.png") and not is_external("data:font/woff2;base64,AA")


def test_site_loads_nothing_from_another_host(site):
    external, missing, loads = [], [], 0
    for path in glob.glob(str(site / "**" / "*.html"), recursive=True):
        with open(path, encoding="utf-8") as fh:
            found = page_loads(fh.read())
        rel = os.path.relpath(path, site)
        for where, url in found:
            loads += 1
            if is_external(url):
                external.append(f"{rel}: {where} {url}")
            elif not url.startswith("data:"):
                target = urllib.parse.urlsplit(url).path
                target = urllib.parse.unquote(target)
                # root-relative (404.html) from the site's root, the rest from the page's folder
                base = str(site) if target.startswith("/") else os.path.dirname(path)
                target = os.path.normpath(os.path.join(base, target.lstrip("/")))
                if os.path.isdir(target):
                    target = os.path.join(target, "index.html")
                if not os.path.exists(target):
                    missing.append(f"{rel}: {where} {url}")
    for path in glob.glob(str(site / "**" / "*.css"), recursive=True):
        with open(path, encoding="utf-8") as fh:
            for a, b in CSS_URL.findall(fh.read()):
                if is_external(a or b):
                    external.append(f"{os.path.relpath(path, site)}: {a or b}")
    assert loads > 50  # the pages were parsed (scripts, stylesheets, images)
    assert not external, "loaded from another host:\n" + "\n".join(sorted(set(external))[:20])
    assert not missing, "loads of files the site does not have:\n" + "\n".join(sorted(set(missing))[:20])

    # the math renderer is the site's own: the page loads it, its fonts are there
    tutorial = (site / "tutorial" / "index.html").read_text(encoding="utf-8")
    assert ("<script src>", "../javascripts/mathjax/tex-mml-chtml.js") in page_loads(tutorial)
    fonts = site / "javascripts" / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2"
    assert (fonts / "MathJax_Main-Regular.woff").is_file() and (fonts / "MathJax_Math-Italic.woff").is_file()
    assert (site / "javascripts" / "mathjax" / "input" / "tex" / "extensions").is_dir()  # \\boldsymbol etc.


# --- everything a reader needs is in the repository -------------------------------------------
def _texts():
    """README, docs pages, proof pages, and the Python sources of the packages and examples."""
    paths = [os.path.join(ROOT, "README.md")]
    for pattern in ("docs/*.md", "docs/design/*.md", "docs/_generated/*.md", "proofs/*.md", "streamkl_ref/*.py",
                    "streamkl_gpu/*.py", "examples/*.py"):
        paths += glob.glob(os.path.join(ROOT, pattern))
    for path in sorted(paths):
        with open(path, encoding="utf-8") as fh:
            yield os.path.relpath(path, ROOT), fh.read()


def test_no_reference_outside_the_repository():
    outside = re.compile(r"MATH\.md|shared/design|\.\./shared|shared design folder")
    found = [f"{name}: {m.group(0)}" for name, text in _texts() for m in outside.finditer(text)]
    assert not found, "point these at docs/math.md instead:\n" + "\n".join(found)
    with open(os.path.join(DOCS, "math.md"), encoding="utf-8") as fh:
        math_page = fh.read()
    for section in ("Inputs", "Scores, masks and distributions", "The loss", "The online recurrence",
                    "Merging two partial states", "Base 2", "Gradients", "What is saved for the backward",
                    "Invisible keys never reach a row", "Packed sequences", "The indexer loss"):
        assert f"\n## {section}" in math_page, section
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as fh:
        assert "math.md" in fh.read()


NUMBERS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty".split())}


def test_statement_counts_are_right():
    """Wherever a text says how many statements the derivation has, it is the number of proof pages."""
    n = len(glob.glob(os.path.join(ROOT, "proofs", "[0-9][0-9]_*.md")))
    said = []
    for name, text in _texts():
        for m in re.finditer(r"\b(\w+) (?:machine-checked )?statements\b", text):
            word = m.group(1).lower()
            count = NUMBERS.get(word, int(word) if word.isdigit() else None)
            if count is not None:
                said.append((name, m.group(0), count))
    wrong = [f"{name}: {phrase!r} (there are {n})" for name, phrase, count in said if count != n]
    assert not wrong, "\n".join(wrong)
