"""The OpenAI-compatible judge (quartet.judges.llm_http) against a small fake server on 127.0.0.1: the verdict rules,
the start-up check's one-line errors, and the transport's retries, limits and failures. Timeouts and backoffs are
tenths of a second, so the whole file takes a few seconds."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from quartet.config import LabelConfig, from_dict
from quartet.errors import ConfigError
from quartet.judges.llm_http import (
    TOP_LOGPROBS,
    JudgeUnavailable,
    OpenAIJudge,
    _retry_after,
    pairwise_log_odds,
    pointwise_rating,
)
from quartet.judges.pairwise import PROMPT_VERSION, judge_messages
from quartet.judges.verdict_cache import CachedJudge, VerdictCache
from quartet.trainers.label import label

RUBRIC = "Prefer the longer answer."


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def length_judge(first: str, second: str):
    """The fake server's judge: log-odds (len(first) - len(second)) / 4, as a top-logprobs list, and its letter."""
    d = (len(first) - len(second)) / 4
    top = [("A", log_sigmoid(d)), ("B", log_sigmoid(-d)), ("The", -12.0)]
    return top, "A" if d >= 0 else "B"


class Fake:
    """What the fake server answers. `script`: actions for the next POSTs in order, then "ok"; each is "ok",
    "malformed", "drop" (close without answer), "die" (close, and stop listening), ("status", code, headers) or
    ("sleep", seconds)."""

    def __init__(self, models=("judge",), key=None):
        self.models, self.key = list(models), key
        self.script: list = []
        self.reply_for = length_judge
        self.rate_for = None
        self.logprobs = True
        self.delay = 0.0
        self.models_body: bytes | None = None
        self.lock = threading.Lock()
        self.posts, self.bodies, self.times = 0, [], []
        self.in_flight = self.most_in_flight = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    def handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            counted = False

            def leave(self):
                """Count this request out of the in-flight ones, once, before the first byte of its reply: the
                client may send its next request the moment it reads this one's, so counting out after the write
                could see one more in flight than the client ever had."""
                if self.counted:
                    self.counted = False
                    with fake.lock:
                        fake.in_flight -= 1

            def send(self, code, body: bytes, headers=()):
                self.leave()
                self.send_response(code)
                for k, v in dict(headers).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def authorised(self):
                if fake.key and self.headers.get("Authorization") != f"Bearer {fake.key}":
                    self.send(401, b'{"error": {"message": "bad key"}}')
                    return False
                return True

            def do_GET(self):
                if not self.authorised():
                    return
                if self.path != "/v1/models":
                    return self.send(404, b"not found")
                body = fake.models_body or json.dumps({"object": "list",
                                                       "data": [{"id": m} for m in fake.models]}).encode()
                self.send(200, body)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.posts += 1
                    fake.bodies.append(body)
                    fake.times.append(time.monotonic())
                    action = fake.script.pop(0) if fake.script else "ok"
                    fake.in_flight += 1
                    fake.most_in_flight = max(fake.most_in_flight, fake.in_flight)
                self.counted = True
                try:
                    self.act(action, body)
                finally:
                    self.leave()

            def act(self, action, body):
                if not self.authorised():
                    return
                if action in ("drop", "die"):
                    self.close_connection = True
                    if action == "die":
                        threading.Thread(target=fake.stop, daemon=True).start()
                    return
                if action == "malformed":
                    return self.send(200, b'{"choices": [')
                if action[0] == "status":
                    return self.send(action[1], b'{"error": "busy"}', action[2] if len(action) > 2 else ())
                time.sleep(action[1] if action[0] == "sleep" else fake.delay)
                user = body["messages"][1]["content"]
                if "\n\nAnswer A:\n" in user:
                    pair = user.split("\n\nAnswer A:\n")[1].split("\n\nReply")[0].split("\n\nAnswer B:\n")
                    top, text = fake.reply_for(*pair)
                else:
                    top, text = fake.rate_for(user.split("\n\nAnswer:\n")[1].split("\n\nReply")[0])
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                if fake.logprobs:
                    lp = dict(top).get(text, min(p for _, p in top))
                    choice["logprobs"] = {"content": [{"token": text, "logprob": lp, "top_logprobs": [
                        {"token": t, "logprob": p} for t, p in top]}]}
                self.send(200, json.dumps({"object": "chat.completion", "choices": [choice]}).encode())

        return Handler


@pytest.fixture
def fake():
    server = Fake()
    yield server
    server.stop()


def judge(fake, **kw):
    kw = {"timeout": 2.0, "max_retries": 2, "backoff": 0.01, "where": "label.llm_judge", **kw}
    return OpenAIJudge(fake.url, "judge", kw.pop("api_key", None), RUBRIC, **kw)


ROWS = (["p1", "p2", "p3"], ["a long answer", "x", "same"], ["short", "a much longer one", "same"])


def test_log_odds_from_the_listed_tokens():
    # both letters: their log-prob difference; a letter's spellings are summed
    assert pairwise_log_odds([("A", -0.2), ("B", -1.8), ("C", -5.0)], "A") == pytest.approx(1.6)
    two = math.log(math.exp(-1.0) + math.exp(-2.0))
    assert pairwise_log_odds([("A", -1.0), (" A", -2.0), ("B", -0.7)], "B") == pytest.approx(two + 0.7)
    assert pairwise_log_odds([("a", -0.1), ("B", -3.0), ("A", -4.0)], "a") == pytest.approx(-1.0)  # case kept
    # a letter not listed takes the smallest log-prob listed: the least the list allows
    assert pairwise_log_odds([("A", -0.1), ("The", -3.0), ("So", -7.5)], "A") == pytest.approx(7.4)
    assert pairwise_log_odds([("I", -0.1), ("B", -2.0), ("So", -6.0)], "I") == pytest.approx(-4.0)
    # neither letter listed, or no list: the text decides, with the fixed margin; anything else is no preference
    assert pairwise_log_odds([("I", -0.1), ("So", -3.0)], " B") == -5.0
    assert pairwise_log_odds(None, "A", text_margin=3.0) == 3.0
    assert pairwise_log_odds(None, "Sure") == 0.0


def test_pointwise_rating_is_the_expected_rating():
    # ratings 6 (p .5) and 9 (p .25) listed: renormalised over the listed ratings, 6 * 2/3 + 9 * 1/3 = 7
    assert pointwise_rating([("6", math.log(0.5)), (" 9", math.log(0.25)), ("The", -1.0)], "6") == \
        pytest.approx(7.0)
    # the scale is 1-9, each rating one token: a "10" listed (a tokenizer that has it) is no rating
    assert pointwise_rating([("10", math.log(0.6)), ("3", math.log(0.2))], "10") == pytest.approx(3.0)
    assert pointwise_rating([("The", -0.1)], "8") == 8.0 and pointwise_rating(None, "9") == 9.0
    assert pointwise_rating(None, "none") == pointwise_rating(None, "0") == pointwise_rating(None, "10") == 5.0


def test_compare_through_the_server(fake):
    j = judge(fake)
    j.check()
    out = j.compare(*ROWS)
    assert out == pytest.approx([(13 - 5) / 4, (1 - 17) / 4, 0.0])
    body = fake.bodies[0]
    assert {k: body[k] for k in ("model", "max_tokens", "temperature", "logprobs", "top_logprobs")} == {
        "model": "judge", "max_tokens": 1, "temperature": 0, "logprobs": True, "top_logprobs": TOP_LOGPROBS}
    assert sorted(json.dumps(b["messages"]) for b in fake.bodies) == sorted(
        json.dumps(judge_messages(RUBRIC, p, f, s)) for p, f, s in zip(*ROWS))
    assert RUBRIC in body["messages"][0]["content"] and body["messages"][0]["role"] == "system"
    assert j.name == f"llm:judge|openai|pairwise|p{PROMPT_VERSION}" and j.requests == 4 and j.retries == 0  # check + 3 rows
    # a server that returns no log-probs: the letter, with the fixed margin
    fake.logprobs = False
    assert judge(fake, text_margin=5.0).compare(*ROWS) == [5.0, -5.0, 5.0]
    # one letter missing from the list: bounded by the smallest listed
    fake.logprobs = True
    fake.reply_for = lambda f, s: ([("B", -0.05), ("The", -4.0), ("It", -6.5)], "B")
    assert judge(fake).compare(["p"], ["a"], ["b"]) == [pytest.approx(-6.45)]


def test_pointwise_mode_rates_each_answer_once(fake):
    fake.rate_for = lambda answer: ([(str(len(answer)), math.log(0.5)), ("9", math.log(0.5))], str(len(answer)))
    j = judge(fake, mode="pointwise")
    # ratings: "a" (1 + 9) / 2 = 5, "bbb" (3 + 9) / 2 = 6; a pair's verdict is the difference
    assert j.compare(["p", "p", "p"], ["a", "bbb", "a"], ["bbb", "a", "a"]) == pytest.approx([-1.0, 1.0, 0.0])
    assert fake.posts == 2 and j.name == f"llm:judge|openai|pointwise|p{PROMPT_VERSION}"
    assert sorted(json.dumps(b["messages"]) for b in fake.bodies) == sorted(
        json.dumps(judge_messages(RUBRIC, "p", x)) for x in ("a", "bbb"))


def test_check_failures_are_one_config_error_each(fake):
    with pytest.raises(ConfigError, match=r"^label\.judge: model 'missing' is not served at http://127\.0\.0\.1:"
                                          r"\d+/v1; it serves: judge$"):
        OpenAIJudge(fake.url, "missing", None, RUBRIC, where="label.llm_judge").check()
    fake.key = "sesame"
    with pytest.raises(ConfigError, match=r"^label\.llm_judge\.api_key_env: http://.*/v1/models refused the API key "
                                          r"\(HTTP 401\): \$MY_KEY is unset$"):
        judge(fake, api_key_env="MY_KEY").check()
    with pytest.raises(ConfigError, match=r"\(HTTP 401\): check the key in \$OPENAI_API_KEY$"):
        judge(fake, api_key="wrong").check()
    judge(fake, api_key="sesame").check()
    fake.key = None
    fake.models_body = b"<html>hello</html>"
    with pytest.raises(ConfigError, match=r"^label\.llm_judge\.base_url: http://.*/v1/models did not answer with an "
                                          r"OpenAI model list"):
        judge(fake).check()
    with pytest.raises(ConfigError, match=r"^eval\.llm_judge\.base_url: GET http://.*/models answered HTTP 404"):
        OpenAIJudge(fake.url[: -len("/v1")], "judge", None, RUBRIC, where="eval.llm_judge").check()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConfigError, match=rf"^label\.llm_judge\.base_url: cannot reach http://127\.0\.0\.1:{port}/v1/"
                                          r"models: connection refused$"):
        OpenAIJudge(f"http://127.0.0.1:{port}/v1", "judge", None, RUBRIC, where="label.llm_judge").check()
    with pytest.raises(ConfigError, match=r"^label\.llm_judge\.base_url: 'localhost:8000/v1' must start with http"):
        OpenAIJudge("localhost:8000/v1", "judge", None, RUBRIC, where="label.llm_judge")


def test_timeouts_are_retried_then_one_error(fake):
    fake.script = [("sleep", 0.6)]
    j = judge(fake, timeout=0.2)
    assert j.compare(["p"], ["aaaa"], [""]) == [pytest.approx(1.0)] and j.retries == 1
    fake.script = [("sleep", 0.6)] * 2
    with pytest.raises(JudgeUnavailable, match=r"^label\.llm_judge\.base_url: the judge server at http://127\.0\.0\.1"
                                               r":\d+/v1/chat/completions gave no verdict in 2 tries \(last: no answer "
                                               r"within 0\.2 s \(timeout\)\); raise label\.llm_judge\.timeout"):
        judge(fake, timeout=0.2, max_retries=1).compare(["p"], ["a"], ["b"])


def test_5xx_dropped_connections_and_malformed_json_are_retried(fake):
    fake.script = [("status", 500), "drop", "malformed", ("status", 503)]
    j = judge(fake, max_retries=4)
    assert j.compare(["p"], ["aaaa"], [""]) == [pytest.approx(1.0)]
    assert j.retries == 4 and fake.posts == 5
    fake.script = [("status", 500)] * 3
    with pytest.raises(JudgeUnavailable, match=r"gave no verdict in 3 tries \(last: HTTP 500\)"):
        judge(fake).compare(["p"], ["a"], ["b"])
    fake.script = ["malformed"] * 3
    with pytest.raises(JudgeUnavailable, match=r"\(last: malformed JSON \(b'\{\"choices\": \['\)\)"):
        judge(fake).compare(["p"], ["a"], ["b"])


def test_429_waits_as_long_as_retry_after_says(fake):
    fake.script = [("status", 429, {"Retry-After": "0.5"})]
    j = judge(fake, backoff=0.01)
    start = time.monotonic()
    assert j.compare(["p"], ["aaaa"], [""]) == [pytest.approx(1.0)]
    assert fake.times[1] - fake.times[0] >= 0.5 and time.monotonic() - start < 2.0
    assert _retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0 and _retry_after("soon") is None
    assert _retry_after("3") == 3.0 and _retry_after(None) is None


def test_a_refused_key_mid_run_is_not_retried(fake):
    fake.key = "sesame"
    with pytest.raises(JudgeUnavailable, match=r"^label\.llm_judge\.api_key_env: .*/chat/completions refused the "
                                               r"API key \(HTTP 401\): \$OPENAI_API_KEY is unset$"):
        judge(fake, max_retries=5).compare(["p"], ["a"], ["b"])
    assert fake.posts == 1


def test_requests_in_flight_are_limited(fake):
    fake.delay = 0.05
    rows = [f"p{i}" for i in range(12)], ["a" * i for i in range(12)], ["aaa"] * 12
    out = judge(fake, max_in_flight=3).compare(*rows)
    assert out == pytest.approx([(i - 3) / 4 for i in range(12)])  # in row order, whatever order they finished in
    assert fake.most_in_flight == 3


def test_a_server_dying_mid_run_keeps_the_rows_judged(fake, tmp_path):
    """The server stops listening after 5 verdicts: the call fails with one line, holding the rows it judged; through
    the verdict cache (committed a chunk at a time) a rerun against the restarted server asks only for the rest."""
    rows = [f"p{i}" for i in range(12)], ["a" * i for i in range(12)], ["aaa"] * 12
    expected = [pytest.approx((i - 3) / 4) for i in range(12)]
    fake.script = ["ok"] * 5 + ["die"]
    with pytest.raises(JudgeUnavailable, match=r"gave no verdict in 3 tries \(last: ") as e:
        judge(fake, max_in_flight=1).compare(*rows)
    assert e.value.finished == dict(enumerate(expected[:5]))

    dying = Fake()
    dying.script = ["ok"] * 5 + ["die"]
    path = tmp_path / "prefs.verdicts.sqlite"
    with VerdictCache(path, "label.llm_judge.cache") as cache:
        cached = CachedJudge(judge(dying, max_in_flight=1), cache, RUBRIC, chunk_size=2)
        with pytest.raises(JudgeUnavailable):
            cached.compare(*rows)
        kept = len(cache)
    assert kept >= 4  # the two whole chunks before the one the server died in
    restarted = Fake()  # another port: the cache is keyed by the served model's name, not the URL
    try:
        with VerdictCache(path, "label.llm_judge.cache") as cache:
            cached = CachedJudge(judge(restarted), cache, RUBRIC, chunk_size=2)
            assert cached.compare(*rows) == expected
        assert restarted.posts == 12 - kept and cached.hits == kept
    finally:
        restarted.stop()


def test_label_through_a_server_that_dies_resumes_where_it_stopped(tmp_path):
    """`quartet label` with an openai judge whose server stops listening mid-run: one error line naming the URL, no
    pairs file, the verdicts judged so far in the cache; the rerun against the restarted server (the same seed
    samples the same answers) asks only for the rest. (That the resumed run's pairs equal an unbroken run's is
    tests/trainers/test_label_llm.py's, with an in-process judge.)"""
    def run(server):
        return label(from_dict(LabelConfig, {
            "policy": "tiny:llama?hidden=32&layers=2&heads=4&vocab=300", "judge": "llm:judge",
            "prompts": {"path": "task:tiny-target/train", "limit": 6, "max_prompt_tokens": 32},
            "llm_judge": {"base_url": server.url, "max_in_flight": 1, "max_retries": 0},  # chunks of 8 verdicts
            "num_samples": 3, "generation": {"max_new_tokens": 8}, "pairing": "all-pairs", "min_gap": 0.0,
            "output": str(tmp_path / "prefs.jsonl")}))

    servers = [Fake(), Fake()]
    try:
        servers[0].script = ["ok"] * 20 + ["die"]
        with pytest.raises(JudgeUnavailable, match=rf"^label\.llm_judge\.base_url: the judge server at "
                                                   rf"{servers[0].url}/chat/completions gave no verdict in 1 try"):
            run(servers[0])
        assert not (tmp_path / "prefs.jsonl").exists()
        with VerdictCache(tmp_path / "prefs.verdicts.sqlite", "label.llm_judge.cache") as cache:
            kept = len(cache)
        assert kept >= 16  # the two chunks of 8 before the one the server died in
        again = run(servers[1])
        stats = again.judge_stats
        assert stats["label/cache_hits"] == kept and stats["label/judge_calls"] == servers[1].posts
        assert kept + servers[1].posts == 2 * stats["label/judge_pairs"] > 21  # every pair, both orders, once
    finally:
        for server in servers:
            server.stop()
