"""Opening a report in Debian's chromium, headless, as the tests that need a real browser do."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

# a test-only copy of a report gets this script (and, in its policy, only the right to run it): it writes
# how many images the page holds and whether every one decoded (natural width > 0)
PROBE = """<script>window.addEventListener('load', () => {
  const imgs = [...document.images];
  const ok = imgs.length > 0 && imgs.every(i => i.complete && i.naturalWidth > 0);
  const p = document.createElement('p'); p.id = 'probe';
  p.textContent = 'images:' + imgs.length + ':' + (ok ? 'loaded' : 'broken');
  document.body.appendChild(p);
});</script>"""

FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run"]

needs_chromium = pytest.mark.skipif(
    shutil.which("chromium") is None, reason="Debian's chromium is not installed (make browser)"
)


def probed_dom(report: Path, work: Path) -> subprocess.CompletedProcess[str]:
    """The DOM chromium builds from a copy of ``report`` with :data:`PROBE` added (stdout) and chromium's
    log (stderr, where console messages appear as ``CONSOLE``). The report's own policy must be the one
    it ships, ``default-src 'none'``, exactly once."""
    page = report.read_text(encoding="utf-8")
    assert page.count("default-src 'none'") == 1  # the policy the report ships
    page = page.replace("default-src 'none';", "default-src 'none'; script-src 'unsafe-inline';")
    probed = work / f"probed-{report.name}"
    probed.write_text(page.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    return subprocess.run(
        ["chromium", *FLAGS, f"--user-data-dir={work / 'profile'}", "--enable-logging=stderr", "--v=0",
         "--virtual-time-budget=5000", "--dump-dom", probed.as_uri()],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip


def console_lines(run: subprocess.CompletedProcess[str]) -> list[str]:
    """The page's console messages in chromium's log."""
    return [line for line in run.stderr.splitlines() if "CONSOLE" in line]
