"""mkdocs hooks (``hooks:`` in mkdocs.yml).

- ``on_config``: make ``pymdownx.snippets``' base path absolute (relative to mkdocs.yml), so
  ``mkdocs build`` works from any working directory.
- ``on_files``: add the derivation pages ``proofs/*.md`` to the site as ``proofs/<name>.md``.
  They are read in place from the repository's ``proofs/`` folder: nothing is copied into
  ``docs/`` and no symlink is needed, so a clean checkout builds as is.
- ``on_page_markdown``: on performance.md, replace the ``<!-- streamkl:plots -->`` marker with
  the PNGs that ``bench/plot.py`` has written to ``docs/assets/`` (whichever exist), or with one
  line saying there are none yet. Regenerating the plots needs no edit of the page.
"""
from __future__ import annotations

import os

from mkdocs.structure.files import File

import glob

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROOFS = os.path.join(ROOT, "proofs")
ASSETS = os.path.join(ROOT, "docs", "assets")
PLOTS_MARKER = "<!-- streamkl:plots -->"
# bench/plot.py's outputs, in reading order, with what each shows
PLOTS = {
    "fwd_time.png": "Forward time vs N (N_Q = N_K), non-causal and causal, per provider.",
    "fwd_bwd_time.png": "Forward + backward time vs N: rows non-causal / causal; columns setting 1, setting 2, both.",
    "peak_memory.png": "Peak extra memory vs N: forward providers, ours up to the longest run, ours fwd+bwd.",
    "decode.png": "Small N_Q (decoding) forward against a long key cache, per provider, with the bandwidth floor.",
    "smallq_bwd.png": "Fused vs separate vs auto backward as N_Q varies at fixed N_K.",
    "sdpa_backends.png": "Our forward against SDPA with the default dispatch, the flash and the cuDNN backends, and torch.compile (N = 8K, 16K).",
}


def on_config(config, **kwargs):
    snippets = config["mdx_configs"].get("pymdownx.snippets")
    if snippets is not None:
        base = snippets.get("base_path", ["."])
        if isinstance(base, str):
            base = [base]
        snippets["base_path"] = [p if os.path.isabs(p) else os.path.join(ROOT, p) for p in base]
    return config


def on_files(files, config, **kwargs):
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
        title = os.path.splitext(name)[0].replace("_", " ")
        caption = PLOTS.get(name, "")
        parts.append(f"### {title}\n\n![{title}](assets/{name})\n\n{caption}".rstrip())
    return "\n\n".join(parts)


def on_page_markdown(markdown, page, config, files, **kwargs):
    if page.file.src_uri == "performance.md":
        if PLOTS_MARKER not in markdown:
            raise RuntimeError(f"performance.md lost its {PLOTS_MARKER} marker")
        markdown = markdown.replace(PLOTS_MARKER, plots_markdown())
    return markdown
