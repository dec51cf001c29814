"""The labelling page as people use it: real headless Chromium (playwright, pointed at the system's chromium) on the
real `quartet annotate` command in a subprocess, bound off loopback so every call goes through the printed token.

One server and one browser for the module, tests in order, as one session: rank with keys (tie, flag), undo, rank with
the mouse, reload and resume, two annotators at once, answers that try to run script, and `kill -9` of the server
then a restart on the same port with every acknowledged judgment in the log and each person back where they were.
"""

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from quartet.annotate.store import LOG, read_judgments

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the dev extra)")
pytest.importorskip("fastapi", reason="the annotate extra is not installed")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")

SCRIPT = "<script>alert(1)</script>"
IMG = '<img src=x onerror="alert(2)">'
PROMPT = "Review the film <b>Heat</b> in one sentence."
ITEMS = [
    (PROMPT, ["A tense, brilliant heist film.", "Great acting and a famous shootout.", SCRIPT, IMG]),
    ("Describe a rainy day.", ["Grey and calm.", "Wet.", "Puddles everywhere, umbrellas out."]),
    ("Name a fruit.", ["Apple.", "Banana.", "A pear, ripe and sweet."]),
    ("Say hello.", ["Hello!", "Hi there.", "Greetings."]),
    ("Count to three.", ["1, 2, 3.", "One two three.", "3, 2, 1."]),
]


class Server:
    """`quartet annotate` in a subprocess; `url` is the page with its token, on 127.0.0.1."""

    def __init__(self, tmp: Path):
        self.samples, self.out = tmp / "pairs.samples.jsonl", tmp / "annotate"
        rows = [{"prompt": p, "completion": a, "score": float(len(a)), "sample": k}
                for p, answers in ITEMS for k, a in enumerate(answers)]
        self.samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
        self.port = 0
        self.acked: list[dict] = []  # every write the server acknowledged to a page

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "quartet.cli", "annotate", str(self.samples), "--out", str(self.out),
             "--per-item", "2", "--host", "0.0.0.0", "--port", str(self.port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout], daemon=True).start()
        seen, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                assert self.proc.poll() is None, "".join(seen)
                continue
            seen.append(line)
            if match := re.search(r"open (http://\S+)", line):
                printed = urlsplit(match.group(1))
                assert printed.query.startswith("token=") and len(printed.query) > 30  # off loopback: a token
                self.port = printed.port
                self.token = printed.query.removeprefix("token=")
                self.url = f"http://127.0.0.1:{self.port}/?{printed.query}"
                return
        self.proc.kill()
        raise AssertionError("the server printed no URL:\n" + "".join(seen))

    def log(self) -> list[dict]:
        return [json.loads(line) for line in (self.out / LOG).read_text().splitlines()]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("annotate"))
    s.start()
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait()


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def people(browser, server):
    """name -> (page, dialogs it saw); each person in their own browser context (own localStorage)."""
    out = {}
    yield out
    for page, _ in out.values():
        page.context.close()


def open_page(browser, server, people, name):
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    page = context.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto(server.url)
    page.fill("#name-input", name)
    page.press("#name-input", "Enter")
    page.wait_for_selector(".answer")
    people[name] = (page, dialogs)
    return page


def send(server, page, action, what="judge"):
    """Do `action` (a key press or a click) that writes; returns the server's acknowledgment."""
    with page.expect_response(lambda r: f"/api/{what}" in r.url) as info:
        action()
    response = info.value
    assert response.status == 200, response.text()
    ack = response.json()
    server.acked.append({"what": what, **ack})
    page.wait_for_function("() => !document.querySelector('#submit').disabled")
    return ack


def position(page) -> int:
    return int(re.search(r"item (\d+) of", page.text_content("#position")).group(1))


def test_the_api_needs_the_token_off_loopback(server):
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/api/progress", timeout=10)
    assert e.value.code == 401
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}/api/progress",
                                     headers={"X-Quartet-Token": server.token})
    assert json.load(urllib.request.urlopen(request, timeout=10))["items"] == len(ITEMS)


def test_answers_that_hold_markup_show_as_text_and_run_nothing(browser, server, people):
    page = open_page(browser, server, people, "alice")
    assert page.text_content("#prompt") == PROMPT
    texts = page.locator(".answer .text").all_text_contents()
    assert texts == ITEMS[0][1]  # the characters themselves, markup and all
    assert page.locator("#prompt b, #answers img, #answers script").count() == 0
    page.wait_for_timeout(200)  # an onerror would fire once the (missing) image failed to load
    assert people["alice"][1] == []  # no alert, prompt or confirm ever opened


def test_rank_tie_and_flag_with_the_keyboard_then_undo(server, people):
    page = people["alice"][0]
    for key in ("2", "1", "t", "3", "ArrowDown", "f"):  # 2 best, then 1 tied with it, then 3; select 4, flag it
        page.keyboard.press(key)
    page.fill("#reason-input", "not an answer")
    page.press("#reason-input", "Enter")
    assert page.text_content("#ranking") == "ranking: 2 = 1  >  3 · complete · 1 flagged"
    assert "flagged: not an answer" in page.text_content('.answer[data-index="3"]')
    ack = send(server, page, lambda: page.keyboard.press("Enter"))
    assert position(page) == 2  # shown only after the server acknowledged the write
    assert server.log()[-1] == {"v": 1, "event": "rank", "id": ack["saved"], "item": ack["item"],
                                "annotator": "alice", "time": server.log()[-1]["time"],
                                "ranking": [[1, 0], [2]], "flags": {"3": "not an answer"}}
    send(server, page, lambda: page.keyboard.press("u"), "undo")
    assert position(page) == 1  # back to the undone item, with its ranking to edit
    assert page.text_content("#ranking") == "ranking: 2 = 1  >  3 · complete · 1 flagged"
    assert server.log()[-1]["event"] == "undo" and server.log()[-1]["undoes"] == ack["saved"]
    page.keyboard.press("Escape")  # clear, and rank again: 1 > 2 > 3, Shift+Up moves 3 above 2
    for key in ("1", "2", "3", "Shift+ArrowUp"):
        page.keyboard.press(key)
    assert page.text_content("#ranking").startswith("ranking: 1  >  3  >  2")
    send(server, page, lambda: page.keyboard.press("Enter"))
    assert server.log()[-1]["ranking"] == [[0], [2], [1]] and position(page) == 2
    send(server, page, lambda: page.keyboard.press("Control+z"), "undo")
    assert position(page) == 1
    send(server, page, lambda: page.keyboard.press("Enter"))
    assert [e["event"] for e in server.log()] == ["rank", "undo", "rank", "undo", "rank"]


def test_rank_with_the_mouse(server, people):
    page = people["alice"][0]
    assert position(page) == 2
    for index in (2, 0, 1):
        page.click(f'.answer[data-index="{index}"] .text')
    page.click('.answer[data-index="1"] button:text("tie")')
    assert page.text_content("#ranking").startswith("ranking: 3  >  1 = 2")
    send(server, page, lambda: page.click("#submit"))
    assert server.log()[-1]["ranking"] == [[2], [0, 1]] and position(page) == 3
    assert "mine 2" in page.text_content("#counts")


def test_reload_keeps_the_name_the_item_and_the_draft(server, people):
    page = people["alice"][0]
    page.keyboard.press("3")
    page.reload()
    page.wait_for_selector(".answer")
    assert page.is_hidden("#name-form") and "alice" in page.text_content("#who")
    assert position(page) == 3 and page.text_content("#ranking").startswith("ranking: 3 ")
    send(server, page, lambda: page.keyboard.press("s"), "skip")
    assert server.log()[-1]["event"] == "skip" and position(page) == 4
    assert "skipped 1" in page.text_content("#counts")


def test_two_annotators_at_once(browser, server, people):
    alice = people["alice"][0]
    bob = open_page(browser, server, people, "bob")
    assert position(bob) == 1  # alice ranked it once; each item goes to two people
    for key in ("4", "3", "1"):  # the last answer left is last: Enter ranks it
        bob.keyboard.press(key)
    for key in ("1", "3"):  # alice, on item 4
        alice.keyboard.press(key)
    # both submit before either answer is read: two writes in flight on one server
    with bob.expect_response(lambda r: "/api/judge" in r.url) as b, \
            alice.expect_response(lambda r: "/api/judge" in r.url) as a:
        bob.keyboard.press("Enter")
        alice.keyboard.press("Enter")
    for info in (a, b):
        assert info.value.status == 200
        server.acked.append({"what": "judge", **info.value.json()})
    for page, n in ((bob, 2), (alice, 5)):
        page.wait_for_function(f"() => document.querySelector('#position').textContent.includes('item {n} of')")
    live = read_judgments(server.out / LOG)
    first = [(j.annotator, j.ranking) for j in live if j.item == live[0].item]
    assert first == [("alice", ((0,), (2,), (1,))), ("bob", ((3,), (2,), (0,), (1,)))]  # neither overwrote
    assert people["bob"][1] == [] and people["alice"][1] == []


def test_kill_9_loses_no_acknowledged_judgment_and_everyone_resumes(server, people):
    alice, bob = people["alice"][0], people["bob"][0]
    bob.keyboard.press("3")
    bob.keyboard.press("1")
    send(server, bob, lambda: bob.keyboard.press("Enter"))  # the last acknowledgment before the kill
    shown = {"alice": position(alice), "bob": position(bob)}
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait()

    acked = [a["saved"] for a in server.acked if a["what"] != "undo"]
    undone = {a["undone"]["id"] for a in server.acked if a["what"] == "undo"}
    live = {j.id for j in read_judgments(server.out / LOG)}
    assert live == set(acked) - undone  # every acknowledged judgment, and nothing else

    server.start()  # same folder, same port: the pages keep their origin (and the names they remembered)
    for name, page in (("alice", alice), ("bob", bob)):
        page.goto(server.url)
        page.wait_for_selector(".answer")
        assert position(page) == shown[name]
    send(server, alice, lambda: alice.keyboard.press("s"), "skip")
    server.proc.send_signal(signal.SIGINT)  # Ctrl-C: a clean stop that says where the judgments are
    assert server.proc.wait(timeout=30) == 0
