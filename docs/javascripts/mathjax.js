// MathJax 3 configuration for pymdownx.arithmatex (generic mode), as in mkdocs-material's docs.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex"
  },
  // the page is typeset once, by the document$ subscription below: typesetting at start-up as
  // well would render every formula a second time inside its own assistive MathML (hidden
  // copies that made pages wider than a phone's screen)
  startup: { typeset: false }
};

// An inline formula wider than its line gets its own horizontal scroll box (class
// streamkl-wide, docs/stylesheets/extra.css) instead of widening the page; the others keep
// their baseline untouched. Re-checked when the window is resized.
function streamklMarkWideMath() {
  document.querySelectorAll(".md-typeset mjx-container:not([display='true'])").forEach((c) => {
    c.classList.remove("streamkl-wide");
    const box = c.parentElement.closest("p, li, td, th, dd, blockquote, .admonition, article") || document.body;
    if (c.getBoundingClientRect().width > box.clientWidth - 2) {
      c.classList.add("streamkl-wide");
    }
  });
}
window.addEventListener("resize", () => streamklMarkWideMath());

document$.subscribe(() => {
  MathJax.startup.output.clearCache();
  MathJax.typesetClear();
  MathJax.texReset();
  MathJax.typesetPromise().then(streamklMarkWideMath);
});
