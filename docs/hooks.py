"""mkdocs hooks (``hooks:`` in mkdocs.yml).

- ``on_config``: make ``pymdownx.snippets``' base path absolute (relative to mkdocs.yml), so
  ``mkdocs build`` works from any working directory.
- ``on_files``: add the derivation pages ``proofs/*.md`` to the site as ``proofs/<name>.md``.
  They are read in place from the repository's ``proofs/`` folder: nothing is copied into
  ``docs/`` and no symlink is needed, so a clean checkout builds as is.
- ``on_files`` also adds MathJax 3 (the CommonHTML build, its fonts and the pieces it loads on
  demand) from the ``django-static-mathjax`` package (the ``docs`` extra) as
  ``javascripts/mathjax/...``: the site ships its math renderer, and no page loads a script, a
  stylesheet or a font from another host (``tests/test_docs.py`` checks the built HTML).
- ``on_page_markdown``: on performance.md, replace the ``<!-- streamkl:plots -->`` marker with
  the PNGs that ``bench/plot.py`` has written to ``docs/assets/`` (whichever exist), or with one
  line saying there are none yet. Regenerating the plots needs no edit of the page.
"""
from __future__ import annotations

import glob
import importlib.util
import os

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROOFS = os.path.join(ROOT, "proofs")
ASSETS = os.path.join(ROOT, "docs", "assets")
MATHJAX_DEST = "javascripts/mathjax"  # where the site serves MathJax's es5/ folder
# Of MathJax's es5/ folder: the one combined component the pages load, and the folders it loads
# parts from on demand (TeX extensions, fonts, the menu, accessibility, speech rules). The other
# combined builds and the SVG output are left out (about 5 MB shipped instead of 24).
MATHJAX_COMPONENT = "tex-mml-chtml.js"
MATHJAX_DIRS = ("a11y", "input", "output", "sre", "ui")
MATHJAX_SKIP = ("output/svg",)
PLOTS_MARKER = "<!-- streamkl:plots -->"
# bench/plot.py's outputs, in reading order: the heading and the caption of each
PLOTS = {
    "fwd_time.png": ("Forward time",
                     "Forward time vs N (N_Q = N_K), non-causal and causal, per provider."),
    "fwd_bwd_time.png": ("Forward + backward time",
                         "Forward + backward time vs N: rows setting 1, setting 2, both; columns non-causal / causal."),
    "peak_memory.png": ("Peak memory",
                        "Peak extra memory vs N: forward providers, ours up to the longest run, ours fwd+bwd."),
    "decode.png": ("Decoding: few queries, long key cache",
                   "Small N_Q (decoding) forward against a long key cache, per provider, with the bandwidth floor."),
    "smallq_bwd.png": ("Backward at small N_Q",
                       "Fused vs separate vs auto backward as N_Q varies at fixed N_K."),
    "sdpa_backends.png": ("Against the SDPA backends",
                          "Our forward against SDPA with the default dispatch, the flash and the cuDNN backends, "
                          "and torch.compile (N = 8K, 16K)."),
}


def on_config(config, **kwargs):
    snippets = config["mdx_configs"].get("pymdownx.snippets")
    if snippets is not None:
        base = snippets.get("base_path", ["."])
        if isinstance(base, str):
            base = [base]
        snippets["base_path"] = [p if os.path.isabs(p) else os.path.join(ROOT, p) for p in base]
    return config


def mathjax_root() -> str:
    """MathJax's ``es5/`` folder inside the installed ``django-static-mathjax`` package."""
    spec = importlib.util.find_spec("mathjax")
    root = None
    if spec is not None and spec.submodule_search_locations:
        root = os.path.join(list(spec.submodule_search_locations)[0], "static", "mathjax", "es5")
    if root is None or not os.path.isfile(os.path.join(root, MATHJAX_COMPONENT)):
        raise RuntimeError("MathJax not found: the docs need the package django-static-mathjax "
                           "(pip install -e '.[docs]')")
    return root


def mathjax_files() -> list[str]:
    """Paths (relative to es5/, with '/') of the MathJax files the site ships."""
    root = mathjax_root()
    out = [MATHJAX_COMPONENT]
    for top in MATHJAX_DIRS:
        for dirpath, _, names in os.walk(os.path.join(root, top)):
            for name in names:
                rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
                if not rel.startswith(MATHJAX_SKIP):
                    out.append(rel)
    return sorted(out)


def on_files(files, config, **kwargs):
    root = mathjax_root()
    for rel in mathjax_files():
        files.append(File.generated(config, f"{MATHJAX_DEST}/{rel}", abs_src_path=os.path.join(root, rel)))
    names = sorted(n for n in os.listdir(PROOFS) if n.endswith(".md"))
    if not names:
        raise RuntimeError(f"no proof pages found in {PROOFS}")
    for name in names:
        # src_dir = the repository root, so the page's path in the site is proofs/<name>
        files.append(File(
            f"proofs/{name}",
            src_dir=ROOT,
            dest_dir=config["site_dir"],
            use_directory_urls=config["use_directory_urls"],
        ))
    return files


def plots_markdown() -> str:
    found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ASSETS, "*.png")))
    if not found:
        return ("*No benchmark plots yet: the GPU benchmark run has not landed in `bench/results/`; "
                "`python bench/plot.py` will write them to `docs/assets/`.*")
    order = [n for n in PLOTS if n in found] + [n for n in found if n not in PLOTS]
    parts = []
    for name in order:
        # a PNG without an entry above still gets a heading in words, never its file name
        title, caption = PLOTS.get(name, (os.path.splitext(name)[0].replace("_", " ").capitalize() + " (plot)", ""))
        # the image links to the full-size PNG (for narrow screens)
        parts.append(f"### {title}\n\n[![{title}](assets/{name})](assets/{name})\n\n{caption}".rstrip())
    return "\n\n".join(parts)


def on_page_markdown(markdown, page, config, files, **kwargs):
    if page.file.src_uri == "performance.md":
        if PLOTS_MARKER not in markdown:
            raise RuntimeError(f"performance.md lost its {PLOTS_MARKER} marker")
        markdown = markdown.replace(PLOTS_MARKER, plots_markdown())
    return markdown
