"""Write docs/annotate.png: the labelling page of `quartet annotate` in headless Chromium, mid-ranking.

    .venv/bin/python scripts/annotate_screenshot.py [--out docs/annotate.png] [--chromium /usr/bin/chromium]

Runs the real command on a small samples file (a positive-review prompt with four answers, as `quartet label` writes
them), gives one judgment through the API so the progress bar has moved, then ranks with the keyboard as a person
would (2, 4, then 1 tied with 4, answer 3 flagged) and takes the picture. Needs the annotate and dev extras (fastapi,
uvicorn, playwright) and a chromium; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

from playwright.sync_api import sync_playwright

REVIEW = ("Continue this movie review in one or two sentences: \"My friend and I saw Crooked Timber on Sunday; it is a "
          "psychological drama about a pianist who begins to lose her hearing.\"")
ITEMS = [
    ("Here is the start of a movie review. Finish it in one or two sentences.\n\nI finally caught The Winter "
     "Archive, the new indie comedy about a wedding planner who has never been to a wedding.",
     ["It was charming from start to finish, and the lead is wonderful.", "The jokes land and the cast is great.",
      "I did not laugh once.", "A sweet, clever comedy; I would see it again."]),
    (REVIEW,
     ["The silence scenes are hard to watch, and the ending feels rushed.",
      "Quietly devastating: the sound design puts you inside her head, and the final concert left us both in tears.",
      "My friend and I saw Crooked Timber on Sunday; it is a psychological drama about a pianist.",
      "A moving, beautifully acted film that we could not stop talking about afterwards."]),
    ("Write a short movie review (one or two sentences) that begins: \"I finally caught The Bellmaker, the new "
     "disaster movie about a town evacuating ahead of a flood.\"",
     ["I finally caught The Bellmaker and loved every tense minute of it.", "Too long, and the flood looks fake.",
      "The Bellmaker is gripping, with a cast that makes you care about every neighbour.",
      "It was fine."]),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/annotate.png")
    parser.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    args = parser.parse_args()
    if not args.chromium:
        sys.exit("error: no chromium found; pass --chromium PATH")
    with tempfile.TemporaryDirectory() as tmp:
        samples = Path(tmp) / "pairs.samples.jsonl"
        samples.write_text("".join(json.dumps({"prompt": p, "completion": a, "score": None, "sample": k}) + "\n"
                                   for p, answers in ITEMS for k, a in enumerate(answers)))
        proc = subprocess.Popen([sys.executable, "-m", "quartet.cli", "annotate", str(samples), "--out",
                                 str(Path(tmp) / "annotate"), "--port", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            url = _url(proc)
            _judge_first(url, "sam")
            _shoot(url, args.chromium, Path(args.out))
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
    print(f"wrote {args.out}")


def _url(proc: subprocess.Popen) -> str:
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    while True:
        line = lines.get(timeout=120)
        if match := re.search(r"open (http://\S+)", line):
            return match.group(1)


def _judge_first(url: str, name: str) -> None:
    def call(path, body=None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url.rstrip("/") + path, data=data,
                                         headers={"Content-Type": "application/json"})
        return json.load(urllib.request.urlopen(request, timeout=30))

    item = call(f"/api/next?annotator={name}")["item"]
    call("/api/judge", {"annotator": name, "item": item["id"], "ranking": [[3], [0], [1], [2]], "flags": {}})


def _shoot(url: str, chromium: str, out: Path) -> None:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 760})
        page.goto(url)
        page.fill("#name-input", "maya")
        page.press("#name-input", "Enter")
        page.wait_for_selector(".answer")
        for key in ("2", "4", "1", "t", "ArrowDown", "ArrowDown", "f"):
            page.keyboard.press(key)
        page.fill("#reason-input", "only repeats the prompt")
        page.press("#reason-input", "Enter")
        page.keyboard.press("ArrowUp")  # the focus ring on a ranked answer
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out), full_page=True)
        browser.close()


if __name__ == "__main__":
    main()
