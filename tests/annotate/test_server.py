"""The annotate server's API in-process (Starlette's TestClient): every bad request is a 4xx with a JSON message, the
token is required when set, a Host that is not loopback is refused on loopback, and the command's own errors."""

import json

import pytest

pytest.importorskip("fastapi", reason="the annotate extra is not installed")
from fastapi.testclient import TestClient  # noqa: E402

from quartet import cli  # noqa: E402
from quartet.annotate.items import load_items  # noqa: E402
from quartet.annotate.server import MAX_BODY, make_app  # noqa: E402
from quartet.annotate.store import Store, read_judgments  # noqa: E402

TOKEN = "t" * 24


@pytest.fixture
def served(tmp_path):
    rows = [{"prompt": f"p{p}", "completion": f"a{p}.{a}", "score": float(a)} for p in range(2) for a in range(3)]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = load_items(tmp_path / "s.jsonl")
    with Store(tmp_path / "out", items, per_item=2) as store:
        yield store, items


def client(store, token=None, loopback=True, host="127.0.0.1:8765"):
    return TestClient(make_app(store, token, loopback), base_url=f"http://{host}", raise_server_exceptions=False)


def test_a_session_through_the_api(served):
    store, items = served
    c = client(store)
    first = c.get("/api/next", params={"annotator": "ann"}).json()
    assert first["item"] == {"id": items[0].id, "prompt": "p0", "answers": ["a0.0", "a0.1", "a0.2"], "position": 1,
                             "reason_max": 500}
    r = c.post("/api/judge", json={"annotator": "ann", "item": items[0].id, "ranking": [[2], [0]],
                                   "flags": {"1": "<b>off</b>"}})
    assert r.status_code == 200 and r.json()["progress"]["mine"] == 1
    assert c.post("/api/skip", json={"annotator": "ann", "item": items[1].id}).status_code == 200
    assert c.get("/api/next", params={"annotator": "ann"}).json()["item"] is None
    undone = c.post("/api/undo", json={"annotator": "ann"}).json()["undone"]
    assert undone["event"] == "skip" and undone["item"] == items[1].id
    assert c.get("/api/next", params={"annotator": "ann"}).json()["item"]["id"] == items[1].id
    assert c.get("/api/progress", params={"annotator": "ann"}).json()["skipped"] == 0
    agreement = c.get("/api/agreement").json()
    assert agreement["judgments"] == 1 and agreement["annotators"] == ["ann"]
    page = c.get("/")
    assert page.status_code == 200 and "/static/app.js" in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert c.get("/static/app.js").status_code == 200
    [j] = read_judgments(store.path)
    assert j.ranking == ((2,), (0,)) and j.flags == {1: "<b>off</b>"}


@pytest.mark.parametrize("path, body, status, message", [
    ("/api/judge", {"annotator": "ann", "item": "0" * 16, "ranking": [[0], [1], [2]]}, 404, "unknown item"),
    ("/api/judge", {"annotator": "ann", "item": "ITEM", "ranking": [[0], [1]]}, 422, "missing [2]"),
    ("/api/judge", {"annotator": "ann", "item": "ITEM", "ranking": [["0"], [1], [2]]}, 422,
     "ranking.0.0: Input should be a valid integer"),
    ("/api/judge", {"annotator": "ann", "item": "ITEM"}, 422, "ranking: Field required"),
    ("/api/judge", {"annotator": "ann", "item": "ITEM", "ranking": [[0, 1, 2]], "admin": True}, 422,
     "admin: Extra inputs are not permitted"),
    ("/api/skip", {"annotator": "", "item": "ITEM"}, 422, "annotator: String should have at least 1 character"),
    ("/api/skip", {"annotator": "x" * 65, "item": "ITEM"}, 422, "annotator: String should have at most 64"),
    ("/api/skip", {"annotator": "a\nb", "item": "ITEM"}, 422, "printable characters"),
    ("/api/skip", [1, 2], 422, "body: Input should be a valid dictionary"),
    ("/api/undo", {"annotator": "nobody"}, 409, "nobody has no judgment to undo"),
])
def test_bad_requests_get_a_4xx_with_a_message(served, path, body, status, message):
    store, items = served
    body = json.loads(json.dumps(body).replace("ITEM", items[0].id))
    r = client(store).post(path, json=body)
    assert r.status_code == status and r.headers["content-type"] == "application/json"
    assert message in r.json()["error"]
    assert store.judgments() == []


def test_malformed_oversize_and_unknown_requests(served):
    store, items = served
    c = client(store)
    r = c.post("/api/judge", content=b'{"annotator": "ann", "item": ', headers={"content-type": "application/json"})
    assert r.status_code == 422 and "JSON decode error" in r.json()["error"]
    # a cross-site form posts text/plain; a JSON body must say it is JSON
    r = c.post("/api/skip", content=json.dumps({"annotator": "ann", "item": items[0].id}),
               headers={"content-type": "text/plain"})
    assert r.status_code == 422
    big = {"annotator": "ann", "item": items[0].id, "ranking": [[0], [1], [2]], "flags": {"0": "x" * MAX_BODY}}
    r = c.post("/api/judge", json=big)
    assert r.status_code == 413 and "over 65536 bytes" in r.json()["error"]

    def chunks():  # no content-length: the cap counts the bytes as they come
        for _ in range(MAX_BODY // 1000 + 2):
            yield b" " * 1000

    assert c.post("/api/skip", content=chunks(), headers={"content-type": "application/json"}).status_code == 413
    assert c.get("/api/nothing").json() == {"error": "Not Found"}
    assert c.delete("/api/judge").status_code == 405
    assert c.get("/api/next").status_code == 422  # no annotator
    assert store.judgments() == []


def test_the_token_is_required_when_set(served):
    store, _ = served
    c = client(store, token=TOKEN, loopback=False, host="10.0.0.5:8765")
    r = c.get("/api/progress")
    assert r.status_code == 401 and "?token=" in r.json()["error"]
    assert c.get("/api/progress", headers={"X-Quartet-Token": "t" * 23 + "u"}).status_code == 401
    assert c.get("/api/progress", headers={"X-Quartet-Token": TOKEN}).status_code == 200
    assert c.get("/api/progress", params={"token": TOKEN}).status_code == 200
    assert c.post("/api/undo", json={"annotator": "a"}).status_code == 401
    assert c.get("/").status_code == 200  # the page holds no data; it reads the token from its own URL


def test_on_loopback_a_foreign_host_header_is_refused(served):
    store, _ = served
    assert client(store, host="localhost:8765").get("/api/progress").status_code == 200
    assert client(store, host="[::1]:8765").get("/api/progress").status_code == 200
    r = client(store, host="attacker.example:8765").get("/api/progress")  # DNS rebinding
    assert r.status_code == 403 and "only on 127.0.0.1" in r.json()["error"]


def test_the_command_refuses_bad_arguments_with_one_line(tmp_path, capsys):
    rows = [{"prompt": "p", "completion": "a"}, {"prompt": "p", "completion": "b"}]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def run(*args):
        code = cli.main(["annotate", *args])
        return code, capsys.readouterr().err

    code, err = run("--out", str(tmp_path / "out"))
    assert code == 2 and err.strip() == ("error: annotate: give the samples file to serve (quartet annotate "
                                         "SAMPLES.jsonl --out DIR), or --export FILE to write the pairs of DIR")
    code, err = run(str(tmp_path / "s.jsonl"), "--out", str(tmp_path / "out"), "--token", "short")
    assert code == 2 and "error: annotate --token: at least 16 characters" in err
    code, err = run(str(tmp_path / "s.jsonl"), "--out", str(tmp_path / "out"), "--per-item", "0", "--port", "0")
    assert code == 2 and "error: annotate.per_item: must be at least 1, got 0" in err
    code, err = run(str(tmp_path / "s.jsonl"), "--out", str(tmp_path / "out"), "--port", "70000")
    assert code == 2 and "error: annotate --port: 0..65535" in err
    assert not (tmp_path / "out").exists()
