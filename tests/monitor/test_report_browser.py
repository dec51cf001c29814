"""The report as a person sees it: headless Chromium loads it with no console errors and every plot decodes.

Skipped when no chromium is installed (`scripts/ensure_chromium.sh` installs Debian's in `make test`).
"""

import re
import shutil
import subprocess

import pytest
from report_fixtures import make_pipeline

from quartet.monitor.report import write_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
def test_report_loads_in_chromium_without_errors(tmp_path):
    page = write_report(make_pipeline(tmp_path / "run"))
    n_images = page.read_text().count("<img ")
    assert n_images >= 10
    out = subprocess.run(
        [
            CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
            "--virtual-time-budget=5000", "--dump-dom", page.as_uri(),
        ],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # every console message (console.error, uncaught exceptions) is logged as INFO:CONSOLE; the page logs none
    console = [line for line in out.stderr.splitlines() if ":CONSOLE" in line]
    assert console == []
    # the page's load handler counts images that decoded to a non-zero width
    match = re.search(r'<body data-images="(\d+)/(\d+)"', out.stdout)
    assert match, out.stdout[:500]
    assert match.group(1) == match.group(2) == str(n_images)
