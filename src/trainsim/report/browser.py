"""Check a report the way a reader sees it: load it in headless Chromium and inspect the rendered page.

A copy of the page gets a small script that runs after the load event and writes, into the DOM, what
the browser actually rendered: every section, every image with its decoded size (0 x 0 = broken), every
table with its row count, and every download link as the browser reads it (a gzipped JSON trace is
decompressed and parsed, and its events counted). `chromium --dump-dom` prints the DOM after scripts
ran; we parse that. The original page stays script-free.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

PROBE = """<script>
async function readDownload(a) {
  const entry = {id: a.id, name: a.getAttribute("download"), bytes: 0, events: null, error: null};
  try {
    let stream = (await fetch(a.href)).body;
    if (entry.name.endsWith(".gz")) stream = stream.pipeThrough(new DecompressionStream("gzip"));
    const text = await new Response(stream).text();
    entry.bytes = text.length;
    if (/[.]json([.]gz)?$/.test(entry.name)) {
      const parsed = JSON.parse(text);
      entry.events = (parsed.traceEvents || parsed).length;
    }
  } catch (e) { entry.error = String(e); }
  return entry;
}
window.addEventListener("load", async () => {
  const out = {
    sections: [...document.querySelectorAll("section")].map(s => s.id),
    images: [...document.images].map(i => ({id: i.id, complete: i.complete, width: i.naturalWidth,
                                            height: i.naturalHeight, shown: i.getBoundingClientRect().width})),
    tables: [...document.querySelectorAll("table")].map(t => ({id: t.id, rows: t.tBodies[0] ?
                                                              t.tBodies[0].rows.length : 0})),
    downloads: await Promise.all([...document.querySelectorAll("a[download]")].map(readDownload)),
    body_height: document.body.scrollHeight,
  };
  const pre = document.createElement("pre");
  pre.id = "render-probe";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


class BrowserError(RuntimeError):
    """No browser, or the browser failed to render the page."""


def find_browser() -> str | None:
    """Path of a Chromium-family browser on PATH (Debian's package is `chromium`), or None."""
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    return None


def render_report(page: Path, *, browser: str | None = None, screenshot: Path | None = None,
                  timeout_s: float = 120) -> dict[str, Any]:
    """What Chromium rendered of `page`: section ids, images (decoded sizes) and tables (body rows)."""
    browser = browser or find_browser()
    if browser is None:
        raise BrowserError(f"no Chromium-family browser on PATH (tried {', '.join(BROWSERS)}); "
                           "install Debian's `chromium` package")
    text = Path(page).read_text()
    if "</body>" not in text:
        raise BrowserError(f"{page}: not a complete HTML page (no </body>)")
    with tempfile.TemporaryDirectory(prefix="trainsim-render-") as tmp:
        probe_page = Path(tmp) / "page.html"
        probe_page.write_text(text.replace("</body>", PROBE + "</body>", 1))
        flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 f"--user-data-dir={tmp}/profile", "--virtual-time-budget=10000", "--window-size=1200,900"]
        env = {**os.environ, "HOME": tmp}
        proc = subprocess.run([*flags, "--dump-dom", probe_page.as_uri()], capture_output=True, text=True,
                              timeout=timeout_s, env=env)
        match = re.search(r'<pre id="render-probe">(.*?)</pre>', proc.stdout, re.S)
        if proc.returncode != 0 or match is None:
            raise BrowserError(f"{browser} did not render {page} (exit {proc.returncode}): {proc.stderr[-2000:]}")
        if screenshot is not None:
            subprocess.run([*flags, f"--screenshot={Path(screenshot).resolve()}", Path(page).resolve().as_uri()],
                           capture_output=True, timeout=timeout_s, env=env, check=False)
    return json.loads(html.unescape(match.group(1)))


def broken_elements(rendered: dict[str, Any], sections: tuple[str, ...]) -> list[str]:
    """Everything a reader would see as missing or broken; empty when the page is whole."""
    problems = [f"section {name!r} missing" for name in sections if name not in rendered["sections"]]
    problems += [f"image {img['id'] or '?'} not decoded ({img['width']}x{img['height']})"
                 for img in rendered["images"] if not img["complete"] or img["width"] == 0 or img["height"] == 0]
    problems += [f"image {img['id'] or '?'} takes no space on the page" for img in rendered["images"]
                 if img["shown"] == 0]
    problems += [f"table {t['id'] or '?'} has no rows" for t in rendered["tables"] if t["rows"] == 0]
    problems += [f"download {d['id'] or d['name']} unreadable ({d['error'] or 'empty'})"
                 for d in rendered.get("downloads", []) if d["error"] or d["bytes"] == 0]
    return problems
