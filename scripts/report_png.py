"""Screenshot an HTML report with headless Chromium (Debian's ``chromium``), full page.

    python scripts/report_png.py docs/report-cartpole.html docs/report-cartpole.png

Chromium's ``--screenshot`` captures the window only, so the page's height is measured first:
a copy with a one-line script that writes ``scrollHeight`` into the title is dumped with
``--dump-dom``; the report itself has no script and is screenshotted as it is.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    sys.exit("chromium not found: apt-get install -y chromium")


def run(args: list[str], profile: Path) -> str:
    cmd = [chromium(), *FLAGS, f"--user-data-dir={profile}", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


def page_height(html: Path, width: int, tmp: Path) -> int:
    probe = tmp / "probe.html"
    script = "<script>document.title=String(document.documentElement.scrollHeight)</script>"
    probe.write_text(html.read_text(encoding="utf-8").replace("</body>", script + "</body>"))
    dom = run([f"--window-size={width},1000", "--dump-dom", probe.as_uri()], tmp / "profile")
    found = re.search(r"<title>(\d+)</title>", dom)
    return int(found.group(1)) if found else 3000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("html", type=Path)
    parser.add_argument("png", type=Path)
    parser.add_argument("--width", type=int, default=820)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="report-png-") as tmp_name:
        tmp = Path(tmp_name)
        height = page_height(args.html.resolve(), args.width, tmp)
        run(
            [
                f"--window-size={args.width},{height}",
                f"--screenshot={args.png.resolve()}",
                args.html.resolve().as_uri(),
            ],
            tmp / "profile",
        )
    print(f"{args.png} ({args.width}x{height})")


if __name__ == "__main__":
    main()
