#!/usr/bin/env python3
"""Look at the built site in a real headless Chromium, with every other host unreachable.

    mkdocs build --strict                       # -> site/
    python docs/check_browser.py                # check site/ (needs `chromium` and `chromedriver`)
    python docs/check_browser.py --screenshots docs/assets/screenshots   # and write screenshots
    python docs/check_browser.py --site DIR --chromium /path/to/chromium

Chromium and its driver come from the system's packages (Debian: ``apt-get install chromium
chromium-driver``); the script talks to chromedriver over its HTTP interface, so no Python package
is needed. This is not
part of the CI suite (CI has no browser); ``tests/test_docs.py`` checks the HTML for external
scripts, stylesheets, fonts and images on every build.

The site is served from 127.0.0.1 by this script. Chromium runs headless with
``--host-resolver-rules`` that make every host but 127.0.0.1 unresolvable, so the pages render as
they would offline. For each page below the served HTML gets a small probe script (added by the
server here, never written into the site) that waits for MathJax and the fonts and images, then
writes what it measured into the page, where the driver reads it. The checks:

- **offline**: every resource the page loaded (scripts, stylesheets, fonts, images) came from
  127.0.0.1;
- **math**: every ``arithmatex`` element was typeset by MathJax (holds an ``mjx-container``), no
  MathJax error, no raw ``\\(``/``\\[`` TeX left in the text of the article;
- **plots**: every image loaded (natural width > 0) and is shown at its natural size or scaled
  down; the smallest text bench/plot.py draws (``MIN_FONT_PT`` at ``DPI``) is at least
  ``MIN_TEXT_PX`` CSS pixels tall at the width the page shows the plot;
- **tables**: every table sits in material's ``.md-typeset__scrollwrap`` with computed
  ``overflow-x: auto``; a table wider than its wrapper can be scrolled to its end; no header
  cell is empty; no identifier (``code``) in a table is broken over two lines;
- **width**: the page is never wider than the window (no sideways scrolling of the page: a long
  formula or table scrolls inside its own box), and no formula is wider than its box without
  being able to scroll;
- **headings**: the page's H1 and every navigation title are words (no file slug such as
  ``01_row_decomposition`` or ``README``; an API name such as ``streamkl_gpu.indexer_kl`` is a
  heading's legitimate text); the body text is at least 12 px.

Every page of the built site is checked (found by walking it: every ``index.html`` but the 404
page), at a phone's width (420 px) and a desktop's (1280 px).

It prints one line per page and check, then a short table; exit status 1 if any check failed.
"""
from __future__ import annotations

import argparse
import base64
import functools
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import plot  # noqa: E402  (bench/plot.py: MIN_FONT_PT, DPI of every figure it draws)

MIN_TEXT_PX = 8.0  # the smallest text a plot may show, in CSS pixels at the page's width
WIDTHS = (420, 1280)  # window widths the pages are probed at: a phone's and a desktop's
# screenshot file -> (page, id of the heading it starts at or None for the top, height in px, width in px)
SCREENSHOTS = {
    "tutorial-420px.png": ("tutorial/", None, 2600, 420),
    "performance-420px.png": ("performance/", None, 2600, 420),
}
# a title that is a file name: README, index, one word with an underscore, something.md
SLUG = re.compile(r"^(README|index|[\w.-]*_[\w.-]*|[\w.-]+\.md)$")
# ... unless it is an API name: a dotted Python name (streamkl_gpu.indexer_kl) or a call (f(...))
API_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$|^[A-Za-z_][\w.]*\(.*\)$")


def site_pages(site: str) -> list[str]:
    """Every page of the built site, as URL paths ("" for the home page), in a stable order."""
    pages = []
    for dirpath, dirnames, filenames in os.walk(site):
        dirnames[:] = sorted(d for d in dirnames if d not in ("assets", "javascripts", "search", "stylesheets"))
        if "index.html" in filenames:
            rel = os.path.relpath(dirpath, site).replace(os.sep, "/")
            pages.append("" if rel == "." else rel + "/")
    return sorted(pages, key=lambda p: (p.count("/"), p))

PROBE = r"""
<script>
(function () {
  function done(result) {
    var pre = document.createElement("pre");
    pre.id = "streamkl-probe";
    pre.style.display = "none";
    pre.textContent = JSON.stringify(result);
    document.body.appendChild(pre);
  }
  function images() {
    return Promise.all(Array.from(document.images).map(function (img) {
      return img.complete ? null : new Promise(function (r) { img.onload = img.onerror = r; });
    }));
  }
  function measure() {
    var article = document.querySelector("article") || document.body;
    var math = Array.from(article.querySelectorAll(".arithmatex"));
    var raw = [];
    var walker = document.createTreeWalker(article, NodeFilter.SHOW_TEXT);
    while (walker.nextNode()) {
      var n = walker.currentNode, p = n.parentElement;
      if (p.closest("pre, code, script, mjx-container, mjx-assistive-mml")) continue;
      if (/\\[\[\(]|\$\$/.test(n.textContent)) raw.push(n.textContent.trim().slice(0, 80));
    }
    // a wide table scrolls if the element that overflows (the table itself, or material's
    // .md-typeset__scrollwrap around it) has overflow-x auto and really moves when scrolled
    function scrolls(el) {
      if (el.scrollWidth <= el.clientWidth + 1) return null;  // not wider than its box
      var before = el.scrollLeft;
      el.scrollLeft = 1e6;
      var moved = el.scrollLeft > 0 && el.scrollLeft + el.clientWidth >= el.scrollWidth - 1;
      el.scrollLeft = before;
      return {overflow_x: getComputedStyle(el).overflowX, moved: moved, width: el.scrollWidth, shown: el.clientWidth};
    }
    var tables = Array.from(article.querySelectorAll("table")).map(function (t) {
      var wrap = t.closest(".md-typeset__scrollwrap");
      return {wrapped: !!wrap, wrap_overflow_x: wrap ? getComputedStyle(wrap).overflowX : null,
              table: scrolls(t), wrap: wrap ? scrolls(wrap) : null};
    });
    var imgs = Array.from(article.querySelectorAll("img")).map(function (img) {
      return {src: img.getAttribute("src"), natural: img.naturalWidth, shown: img.getBoundingClientRect().width};
    });
    var nav = Array.from(document.querySelectorAll(".md-nav--primary .md-nav__link")).map(function (a) {
      return a.textContent.trim();
    }).filter(function (s) { return s.length; });
    var resources = performance.getEntriesByType("resource").map(function (e) { return e.name; });
    var h1 = article.querySelector("h1");
    var headings = Array.from(article.querySelectorAll("h1, h2, h3")).map(function (h) {
      var code = Array.from(h.querySelectorAll("code")).map(function (c) { return c.textContent; }).join("");
      return {id: h.id, text: h.textContent.replace(/\s+/g, " ").replace("¶", "").trim(),
              code: code.replace(/\s+/g, " ").trim(),
              y: h.getBoundingClientRect().top + window.scrollY};
    });
    var root = document.documentElement;
    var empty_th = Array.from(article.querySelectorAll("th")).filter(function (th) {
      return !th.textContent.trim();
    }).length;
    var broken_code = Array.from(article.querySelectorAll("td code, th code")).filter(function (c) {
      return c.getClientRects().length > 1;
    }).map(function (c) { return c.textContent.slice(0, 60); });
    var wide_inline = Array.from(article.querySelectorAll("mjx-container:not([display='true'])")).filter(function (c) {
      var r = c.getBoundingClientRect();
      return r.right > root.clientWidth + 1;
    }).map(function (c) { return {width: Math.round(c.getBoundingClientRect().width),
                                  text: (c.closest(".arithmatex") || c).textContent.slice(0, 50)}; });
    var wide_math = Array.from(article.querySelectorAll("div.arithmatex")).filter(function (e) {
      return e.scrollWidth > e.clientWidth + 1;
    }).map(function (e) {
      return {overflow_x: getComputedStyle(e).overflowX, width: e.scrollWidth, shown: e.clientWidth,
              start: (e.previousElementSibling || {textContent: ""}).textContent.trim().slice(-60)};
    });
    done({
      math: math.length,
      typeset: math.filter(function (e) { return e.querySelector("mjx-container"); }).length,
      merror: article.querySelectorAll("mjx-merror").length,
      raw_tex: raw,
      tables: tables,
      images: imgs,
      h1: h1 ? h1.textContent.replace(/\s+/g, " ").replace("¶", "").trim() : null,
      headings: headings,
      wide_math: wide_math,
      wide_inline: wide_inline,
      page_width: root.scrollWidth,
      viewport: root.clientWidth,
      empty_th: empty_th,
      broken_code: broken_code,
      nav: nav,
      resources: resources,
      body_font_px: parseFloat(getComputedStyle(article).fontSize),
      body_font: getComputedStyle(article).fontFamily
    });
  }
  window.addEventListener("load", function () {
    var ready = (window.MathJax && MathJax.startup && MathJax.startup.promise) || Promise.resolve();
    ready.then(function () { return MathJax.typesetPromise ? MathJax.typesetPromise() : null; })
         .then(function () { return document.fonts.ready; })
         .then(images)
         .then(function () { setTimeout(measure, 200); },
               function (e) { done({error: String(e)}); });
  });
})();
</script>
"""


class Handler(http.server.SimpleHTTPRequestHandler):
    """Serves the site; ``?probe`` on an HTML page adds the probe script before ``</body>``."""

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        path, _, query = self.path.partition("?")
        if query != "probe":
            return super().do_GET()
        local = self.translate_path(path)
        if os.path.isdir(local):
            local = os.path.join(local, "index.html")
        with open(local, "rb") as fh:
            html = fh.read().decode("utf-8")
        body = html.replace("</body>", PROBE + "</body>", 1).encode("utf-8")
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def chromium_args() -> list[str]:
    """Headless and offline. Scrollbars stay visible: a screenshot shows which tables scroll."""
    return ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run",
            "--disable-extensions", "--mute-audio",
            # offline: no host resolves except the local server
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            f"--user-data-dir={tempfile.mkdtemp(prefix='streamkl-chromium-')}"]


class Browser:
    """One headless Chromium driven through chromedriver's WebDriver HTTP interface (no Python
    package needed). The window width is set by Chrome DevTools' device-metrics override, because
    a headless window is never narrower than 500 px: a 420 px check needs the override."""

    def __init__(self, chromium: str, chromedriver: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([chromedriver, f"--port={self.port}"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                self._call("GET", "/status")
                break
            except OSError:
                time.sleep(0.1)
        caps = {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
            "binary": shutil.which(chromium) or chromium, "args": chromium_args()}}}}
        self.sid = self._call("POST", "/session", caps)["sessionId"]

    def _call(self, method: str, path: str, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method, data=data,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=180) as fh:
            return json.loads(fh.read())["value"]

    def _s(self, method: str, path: str, body=None):
        return self._call(method, f"/session/{self.sid}{path}", body if body is not None else ({} if method == "POST" else None))

    def open(self, url: str, width: int, height: int) -> None:
        self._s("POST", "/goog/cdp/execute", {"cmd": "Emulation.setDeviceMetricsOverride", "params": {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}})
        self._s("POST", "/url", {"url": url})

    def run(self, script: str):
        return self._s("POST", "/execute/sync", {"script": script, "args": []})

    def probe(self, base: str, page: str, width: int, timeout: float = 60) -> dict:
        self.open(f"{base}/{page}?probe", width, 2000)
        end = time.time() + timeout
        while time.time() < end:
            found = self.run("var e = document.getElementById('streamkl-probe'); return e && e.textContent;")
            if found:
                return json.loads(found)
            time.sleep(0.2)
        return {"error": "the probe did not report (MathJax or the page did not finish loading)"}

    def screenshot(self, base: str, page: str, width: int, height: int, out: str) -> None:
        self.probe(base, page, width)  # MathJax, fonts and images done
        self.open(f"{base}/{page}?probe", width, height)
        self.probe(base, page, width)
        self._s("POST", "/goog/cdp/execute", {"cmd": "Emulation.setDeviceMetricsOverride", "params": {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}})
        with open(out, "wb") as fh:
            fh.write(base64.b64decode(self._s("GET", "/screenshot")))

    def close(self) -> None:
        try:
            self._call("DELETE", f"/session/{self.sid}")
        finally:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def check(page: str, width: int, r: dict, port: int) -> list[str]:
    """The failed checks of one probe result (empty: all passed)."""
    if "error" in r:
        return [r["error"]]
    bad = []
    local = (f"http://127.0.0.1:{port}/",)
    foreign = [u for u in r["resources"] if not u.startswith(local)]
    if foreign:
        bad.append(f"loaded from another host: {foreign}")
    if r["typeset"] != r["math"] or r["merror"]:
        bad.append(f"math: {r['typeset']} of {r['math']} formulas typeset, {r['merror']} MathJax errors")
    if r["raw_tex"]:
        bad.append(f"raw TeX in the text: {r['raw_tex'][:3]}")
    for img in r["images"]:
        if not img["natural"]:
            bad.append(f"image not loaded: {img['src']}")
            continue
        # plots: readable at the desktop width (narrower screens can open the PNG: it is a link)
        if width >= 1280 and img["src"].endswith(".png") and "screenshots" not in img["src"]:
            text_px = plot.MIN_FONT_PT * plot.DPI / 72 * img["shown"] / img["natural"]
            if text_px < MIN_TEXT_PX:
                bad.append(f"plot {img['src']}: smallest text {text_px:.1f} px at {img['shown']:.0f} px wide "
                           f"(natural {img['natural']} px), under {MIN_TEXT_PX} px")
    for i, t in enumerate(r["tables"]):
        if not t["wrapped"] or t["wrap_overflow_x"] != "auto":
            bad.append(f"table {i}: wrapped={t['wrapped']} overflow-x={t['wrap_overflow_x']}")
        for part in ("table", "wrap"):
            s = t[part]
            if s and (s["overflow_x"] not in ("auto", "scroll") or not s["moved"]):
                bad.append(f"table {i}: {s['width']} px wide in {s['shown']} px, cut off ({part} {s})")
    # a heading set in code (`streamkl_gpu.indexer_kl`) or shaped like an API name is one
    titles = [h["text"] for h in r["headings"] if not (h.get("code") and h["code"] == h["text"])] + r["nav"]
    stems = {os.path.splitext(os.path.basename(i["src"]))[0] for i in r["images"]}
    stems |= {s.replace("_", " ") for s in stems}
    slugs = [t for t in titles if (SLUG.search(t) and not API_NAME.match(t)) or t in stems]
    if slugs:
        bad.append(f"headings or nav titles that are file names: {slugs}")
    if not r["h1"]:
        bad.append("no H1")
    if any(m["overflow_x"] not in ("auto", "scroll") for m in r["wide_math"]):
        bad.append(f"display formulas wider than the page that cannot scroll: {r['wide_math']}")
    if r["page_width"] > r["viewport"] + 1:
        bad.append(f"page {r['page_width']} px wide in a {r['viewport']} px window (scrolls sideways)"
                   + (f"; inline formulas past the edge: {r['wide_inline'][:3]}" if r["wide_inline"] else ""))
    if r["empty_th"]:
        bad.append(f"{r['empty_th']} empty table header cell(s)")
    if r["broken_code"]:
        bad.append(f"identifiers broken over two lines in tables: {r['broken_code'][:4]}")
    if r["body_font_px"] < 12:
        bad.append(f"body text {r['body_font_px']} px")
    return bad


def shrink_png(path: str, limit: int, top: int = 0) -> None:
    """Crop ``top`` pixels off, then a palette PNG (256 colours) so a screenshot stays under
    ``limit`` bytes where it can (Pillow comes with matplotlib, in the docs extra)."""
    from PIL import Image
    img = Image.open(path).convert("RGB")
    img = img.crop((0, top, img.width, img.height))
    img.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    if os.path.getsize(path) > limit:  # then scale it down a little
        img = img.resize((img.width * 3 // 4, img.height * 3 // 4), Image.LANCZOS)
        img.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--site", default=os.path.join(ROOT, "site"), help="the built site (default: site/)")
    ap.add_argument("--chromium", default=shutil.which("chromium") or "chromium", help="the browser")
    ap.add_argument("--chromedriver", default=shutil.which("chromedriver") or "chromedriver",
                    help="its WebDriver (Debian: apt-get install chromium-driver)")
    ap.add_argument("--verbose", action="store_true", help="also list the display formulas that scroll")
    ap.add_argument("--screenshots", metavar="DIR", help="also write the screenshots of SCREENSHOTS here")
    args = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(args.site, "index.html")):
        print(f"no site in {args.site}: run `mkdocs build --strict` first", file=sys.stderr)
        return 2
    if not shutil.which(args.chromium):
        print(f"no browser {args.chromium!r}: install Chromium (Debian: apt-get install chromium)", file=sys.stderr)
        return 2
    if not shutil.which(args.chromedriver):
        print(f"no {args.chromedriver!r}: install it (Debian: apt-get install chromium-driver)", file=sys.stderr)
        return 2

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(Handler, directory=args.site))
    port = server.server_address[1]
    base = f"http://127.0.0.1:{port}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    failed, summary = 0, []
    browser = Browser(args.chromium, args.chromedriver)
    try:
        pages = site_pages(args.site)
        print(f"{len(pages)} pages in {args.site}")
        for page in pages:
            for width in WIDTHS:
                r = browser.probe(base, page, width)
                bad = check(page, width, r, port)
                failed += bool(bad)
                name = "/" + page
                for b in bad:
                    print(f"FAIL {name} @{width}px: {b}")
                if args.verbose:
                    for m in r.get("wide_math", []):
                        print(f"note {name} @{width}px: formula {m['width']} px wide in {m['shown']} px scrolls "
                              f"(after: ...{m['start']!r})")
                if "error" not in r:
                    wide = sum(bool(t["table"] or t["wrap"]) for t in r["tables"])
                    summary.append((name, width, f"{r['page_width']}", f"{r['typeset']}/{r['math']}", len(r["wide_math"]), len(r["images"]),
                                    f"{len(r['tables'])} ({wide} wide)", len(r["resources"]),
                                    "ok" if not bad else "FAIL"))
                else:
                    summary.append((name, width, "-", "-", "-", "-", "-", "-", "FAIL"))
        if args.screenshots:
            os.makedirs(args.screenshots, exist_ok=True)
            for name, (page, anchor, height, width) in SCREENSHOTS.items():
                out = os.path.abspath(os.path.join(args.screenshots, name))
                top = 0
                if anchor:  # a window tall enough to reach it, then cropped
                    found = [h["y"] for h in browser.probe(base, page, width).get("headings", [])
                             if h["id"] == anchor]
                    if not found:
                        raise RuntimeError(f"no heading #{anchor} on /{page}")
                    top = max(0, int(found[0]) - 24)
                browser.screenshot(base, page, width, top + height, out)
                shrink_png(out, 400_000, top)
                print(f"wrote {out} ({os.path.getsize(out) // 1024} KB)")
    finally:
        browser.close()
        server.shutdown()

    print()
    head = ("page", "window", "page width", "formulas", "scrolling", "images", "tables", "resources", "result")
    rows = [head] + [tuple(str(c) for c in s) for s in summary]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    print(f"{len(summary) - failed} of {len(summary)} page checks passed (every host but 127.0.0.1 unreachable)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
