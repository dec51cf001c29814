"""An LLM judge behind any OpenAI-compatible HTTP server (`vllm serve`, llama.cpp's server, Ollama, a hosted API).

Each verdict is one POST {base_url}/chat/completions: the messages of :func:`quartet.judges.pairwise.judge_messages`
(the local judge reads the same text), ``max_tokens: 1``, ``temperature: 0``, ``logprobs: true``,
``top_logprobs: 20``. The verdict is read from the log-probs the server lists for its one token:

- pairwise: log-odds that the first answer is better, ``log p(A) - log p(B)``. A letter's probability is the sum over
  its spellings in the list (``"A"``, ``" A"``: whitespace stripped, case kept). A letter missing from the list has
  at most the probability of the least likely token listed (the list is the top 20), so it is given that log-prob:
  the log-odds reported is then the smallest the list allows (a lower bound on its size, never an invented margin).
  Neither letter listed, or no log-probs at all (a server that does not return them): the reply's text decides,
  ``+text_margin`` for A, ``-text_margin`` for B, 0 (no preference) for anything else.
- pointwise: the expected rating over the ratings 1-9 listed, their probabilities renormalised (ratings not
  listed count as 0); none listed: the number the reply starts with, else the middle of the scale (5). The scale
  stops at 9 so that each rating is one token: a tokenizer that splits "10" into "1", "0" (SmolLM2, Llama's)
  would list a 10's first token as "1", and a one-token reply would read it as a 1.

Transport is the standard library's urllib (no new dependency), ``max_in_flight`` requests at once from a thread
pool. A 429, a 5xx, a refused or reset connection, a timeout and a reply that is not the JSON expected are retried
up to ``max_retries`` times with exponential backoff and jitter (a Retry-After header is honoured, up to
``max_backoff``); then :class:`JudgeUnavailable` names the URL and the last failure. A 4xx other than 429 is not
retried: the request itself is wrong. A compare() call that fails keeps the rows it had judged on the error
(``.finished``); the verdict cache stores them, and a caller that asks in chunks loses at most one chunk's work.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import math
import random
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed

from quartet.errors import ConfigError
from quartet.judges.pairwise import PROMPT_VERSION, judge_messages

TOP_LOGPROBS = 20  # the most OpenAI's API and vLLM's default (max_logprobs) return
TEXT_MARGIN = 5.0  # log-odds of a verdict read from text only: p(A) = 0.993, firmer than most logprob verdicts
VERDICTS = ("A", "B")  # the letters judge_messages asks for: A = the first answer is better
RATINGS = tuple(str(r) for r in range(1, 10))  # the pointwise scale judge_messages asks for
NEUTRAL_RATING = 5.0  # the middle of that scale: a pointwise reply that gave no rating


class JudgeUnavailable(ConfigError):
    """The judge server failed a request past its retries (or refused it outright); one line naming the URL and the
    last failure. ``finished``: {row index: verdict} of the call's rows judged before it failed."""

    def __init__(self, message: str, finished: dict[int, float] | None = None):
        super().__init__(message)
        self.finished = dict(finished or {})


class _Retryable(Exception):
    """A failure worth another try; ``status`` says what it was, ``retry_after`` what the server asked to wait."""

    def __init__(self, status: str, retry_after: float | None = None):
        super().__init__(status)
        self.status, self.retry_after = status, retry_after


class _Stopped(Exception):
    """Another row of the same call failed: this one gives up without another try."""


class OpenAIJudge:
    """A pairwise (or pointwise) judge: one chat-completions request per verdict, read from its token log-probs."""

    def __init__(self, base_url: str, model: str, api_key: str | None, rubric: str, mode: str = "pairwise",
                 timeout: float = 60.0, max_retries: int = 5, max_in_flight: int = 8, *, where: str = "llm_judge",
                 api_key_env: str = "OPENAI_API_KEY", backoff: float = 1.0, max_backoff: float = 60.0,
                 text_margin: float = TEXT_MARGIN):
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"{where}.base_url: {base_url!r} must start with http:// or https://")
        if mode not in ("pairwise", "pointwise"):
            raise ConfigError(f"{where}.mode: must be pairwise or pointwise, got {mode!r}")
        self.base_url, self.model, self.rubric, self.mode = base_url.rstrip("/"), model, rubric, mode
        self.timeout, self.max_retries, self.max_in_flight = timeout, max_retries, max_in_flight
        self.where, self.api_key_env, self.api_key = where, api_key_env, api_key
        self.backoff, self.max_backoff, self.text_margin = backoff, max_backoff, text_margin
        # the served model's name, not the URL: the same server moved to another port keeps its cached verdicts
        self.name = f"llm:{model}|openai|{mode}|p{PROMPT_VERSION}"
        self.requests = 0  # HTTP requests sent, retries included
        self.retries = 0
        self._headers = {"Content-Type": "application/json", "User-Agent": "quartet"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._lock = threading.Lock()
        self._rng = random.Random()  # jitter from its own generator: the run's seeded random state stays untouched
        self._scores: dict[tuple[str, str], float] = {}  # pointwise: an answer is rated once, whatever it meets

    # ---- start-up check -------------------------------------------------------------------------------------

    def check(self, where: str | None = None) -> None:
        """GET {base_url}/models once: an unreachable server, a refused key, a model it does not serve or an answer
        that is not an OpenAI model list is one ConfigError naming the config field."""
        where = where or self.where
        url = f"{self.base_url}/models"
        try:
            reply = json.loads(self._send(urllib.request.Request(url, headers=self._headers)))
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                raise ConfigError(self._key_message(where, url, e.code)) from None
            raise ConfigError(f"{where}.base_url: GET {url} answered HTTP {e.code}; an OpenAI-compatible server "
                              f"lists its models there (does base_url end in /v1?)") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise ConfigError(f"{where}.base_url: cannot reach {url}: {_reason(e, self.timeout)}") from None
        except ValueError:
            reply = None
        models = reply.get("data") if isinstance(reply, dict) else None
        if not isinstance(models, list) or not all(isinstance(m, dict) and "id" in m for m in models):
            raise ConfigError(f"{where}.base_url: {url} did not answer with an OpenAI model list; is it the /v1 URL "
                              f"of an OpenAI-compatible server?")
        served = [str(m["id"]) for m in models]
        if self.model not in served:
            field = f"{where.rpartition('.')[0]}.judge" if "." in where else "judge"
            listed = ", ".join(served[:20]) + (f" and {len(served) - 20} more" if len(served) > 20 else "")
            raise ConfigError(f"{field}: model '{self.model}' is not served at {self.base_url}; it serves: "
                              f"{listed or 'nothing'}")

    # ---- verdicts -------------------------------------------------------------------------------------------

    def compare(self, prompts: list[str], firsts: list[str], seconds: list[str]) -> list[float]:
        """Log-odds that each first answer is better than its second (> 0 first); pointwise: the difference of
        their ratings. Rows are independent requests, so the call may be split into chunks freely."""
        if not len(prompts) == len(firsts) == len(seconds):
            raise ValueError("compare() needs as many prompts, firsts and seconds")
        if self.mode == "pointwise":
            a, b = self.score(prompts, firsts), self.score(prompts, seconds)
            return [x - y for x, y in zip(a, b)]
        bodies = [self._body(judge_messages(self.rubric, p, f, s))
                  for p, f, s in zip(prompts, firsts, seconds)]
        return self._ask_all(bodies, self._log_odds)

    def score(self, prompts: list[str], answers: list[str]) -> list[float]:
        """Pointwise rating of each answer, 1 (worst) to 9 (best); each distinct (prompt, answer) asked once."""
        keys = list(zip(prompts, answers))
        with self._lock:
            todo = list(dict.fromkeys(k for k in keys if k not in self._scores))
        bodies = [self._body(judge_messages(self.rubric, p, a)) for p, a in todo]
        try:
            ratings = self._ask_all(bodies, self._rating)
        except JudgeUnavailable as e:
            with self._lock:
                self._scores.update({todo[i]: r for i, r in e.finished.items()})
            e.finished = {}  # finished answers, not rows: kept here, not handed on as verdicts
            raise
        with self._lock:
            self._scores.update(zip(todo, ratings))
            return [self._scores[k] for k in keys]

    def _body(self, messages: list[dict[str, str]]) -> dict:
        return {"model": self.model, "messages": messages, "max_tokens": 1, "temperature": 0,
                "logprobs": True, "top_logprobs": TOP_LOGPROBS}

    def _log_odds(self, reply: dict) -> float:
        top, text = _first_token(reply)
        return pairwise_log_odds(top, text, self.text_margin)

    def _rating(self, reply: dict) -> float:
        top, text = _first_token(reply)
        return pointwise_rating(top, text)

    # ---- transport ------------------------------------------------------------------------------------------

    def _ask_all(self, bodies: list[dict], read) -> list[float]:
        """POST every body, at most max_in_flight at once; the verdicts in order. The first row that fails past its
        retries stops the others (no new tries) and is raised with the rows finished by then."""
        if not bodies:
            return []
        stop = threading.Event()
        pool = ThreadPoolExecutor(min(self.max_in_flight, len(bodies)), thread_name_prefix="quartet-judge")
        futures = [pool.submit(self._ask, body, read, stop) for body in bodies]
        failed = None
        try:
            for future in as_completed(futures):
                if future.exception() is not None:
                    failed = future
                    stop.set()
                    break
        except BaseException:  # Ctrl-C: no new tries; requests on the wire end within their timeout
            stop.set()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown(wait=True, cancel_futures=True)  # the rows on the wire when one failed finish first
        if failed is None:
            return [f.result() for f in futures]
        error = failed.exception()
        if isinstance(error, JudgeUnavailable):
            error.finished = {i: f.result() for i, f in enumerate(futures)
                              if f.done() and not f.cancelled() and f.exception() is None}
        raise error

    def _ask(self, body: dict, read, stop: threading.Event) -> float:
        """One verdict, with the retries; :class:`JudgeUnavailable` once they are spent."""
        url = f"{self.base_url}/chat/completions"
        data = json.dumps(body).encode()
        for attempt in range(self.max_retries + 1):
            if stop.is_set():
                raise _Stopped
            try:
                return read(self._post(url, data))
            except _Retryable as e:
                last = e
            if attempt == self.max_retries:
                break
            with self._lock:
                self.retries += 1
            wait = last.retry_after if last.retry_after is not None else \
                self.backoff * 2 ** attempt * (0.5 + 0.5 * self._rng.random())  # "equal jitter"
            if stop.wait(min(wait, self.max_backoff)):
                raise _Stopped
        tries = self.max_retries + 1
        raise JudgeUnavailable(
            f"{self.where}.base_url: the judge server at {url} gave no verdict in {tries} "
            f"tr{'y' if tries == 1 else 'ies'} (last: {last.status}); raise {self.where}.timeout or "
            f"{self.where}.max_retries if it is only slow; a rerun asks only for verdicts not in the verdict cache")

    def _post(self, url: str, data: bytes) -> dict:
        """One POST: the reply as JSON, :class:`_Retryable` for what may pass, JudgeUnavailable for what will not."""
        request = urllib.request.Request(url, data=data, headers=self._headers, method="POST")
        try:
            raw = self._send(request)
        except urllib.error.HTTPError as e:
            if e.code == 429 or e.code >= 500:
                raise _Retryable(f"HTTP {e.code}", _retry_after(e.headers.get("Retry-After"))) from None
            if e.code in (401, 403):
                raise JudgeUnavailable(self._key_message(self.where, url, e.code)) from None
            raise JudgeUnavailable(f"{self.where}.base_url: POST {url} answered HTTP {e.code}: "
                                   f"{_error_detail(e)}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise _Retryable(_reason(e, self.timeout)) from None
        try:
            reply = json.loads(raw)
        except ValueError:
            raise _Retryable(f"malformed JSON ({raw[:60]!r})") from None
        if not isinstance(reply, dict):
            raise _Retryable(f"a reply that is not a JSON object ({raw[:60]!r})")
        return reply

    def _send(self, request: urllib.request.Request) -> bytes:
        with self._lock:
            self.requests += 1
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            return response.read()

    def _key_message(self, where: str, url: str, code: int) -> str:
        key = f"${self.api_key_env} is unset" if not self.api_key else f"check the key in ${self.api_key_env}"
        return f"{where}.api_key_env: {url} refused the API key (HTTP {code}): {key}"


def _first_token(reply: dict) -> tuple[list[tuple[str, float]] | None, str]:
    """(the listed (token, logprob) of the reply's one token, or None when the server gave none; the reply text).
    A reply without choices is malformed (retried)."""
    try:
        choice = reply["choices"][0]
        text = (choice.get("message") or {}).get("content") or choice.get("text") or ""
    except (KeyError, IndexError, TypeError, AttributeError):
        raise _Retryable(f"a reply without choices ({json.dumps(reply)[:60]})") from None
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    if not content or not isinstance(content[0], dict):
        return None, str(text)
    first = content[0]
    entries = [first] + list(first.get("top_logprobs") or [])
    top = []
    for entry in entries:
        if isinstance(entry, dict) and isinstance(entry.get("token"), str):
            lp = entry.get("logprob")
            if isinstance(lp, int | float) and not isinstance(lp, bool) and math.isfinite(lp):
                top.append((entry["token"], float(lp)))
    top = list(dict(top).items())  # the sampled token is listed twice, with one log-prob
    return top or None, str(text)


def _logsumexp(values: list[float]) -> float:
    m = max(values)
    return m + math.log(sum(math.exp(v - m) for v in values))


def _mass(top: list[tuple[str, float]], labels) -> dict[str, float]:
    """log-probability of each label present in the list, summed over its spellings (whitespace stripped)."""
    found: dict[str, list[float]] = {}
    for token, lp in top:
        if token.strip() in labels:
            found.setdefault(token.strip(), []).append(lp)
    return {label: _logsumexp(lps) for label, lps in found.items()}


def pairwise_log_odds(top: list[tuple[str, float]] | None, text: str, text_margin: float = TEXT_MARGIN) -> float:
    """log p(A) - log p(B) from the listed top tokens; a letter not listed takes the smallest listed log-prob (it
    can be no likelier than that); neither listed or no list: +/- text_margin from the reply's text, else 0."""
    if top:
        mass = _mass(top, VERDICTS)
        if mass:
            floor = min(lp for _, lp in top)
            return mass.get(VERDICTS[0], floor) - mass.get(VERDICTS[1], floor)
    verdict = text.strip()[:1]
    return text_margin if verdict == VERDICTS[0] else -text_margin if verdict == VERDICTS[1] else 0.0


def pointwise_rating(top: list[tuple[str, float]] | None, text: str) -> float:
    """Expected rating over the ratings listed (renormalised); none listed: the reply's number, else the middle."""
    if top:
        mass = _mass(top, RATINGS)
        if mass:
            m = max(mass.values())
            weights = {int(d): math.exp(lp - m) for d, lp in mass.items()}
            return sum(d * w for d, w in weights.items()) / sum(weights.values())
    number = re.match(r"\d+", text.strip())
    return float(number.group()) if number and number.group() in RATINGS else NEUTRAL_RATING


def _retry_after(value: str | None) -> float | None:
    """Seconds a Retry-After header asks for (delta-seconds or an HTTP date), None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _reason(e: BaseException, timeout: float) -> str:
    """Why a connection failed, in a few words: "connection refused", "timed out after 60 s", "Name or service..."."""
    reason = e.reason if isinstance(e, urllib.error.URLError) else e
    if isinstance(reason, TimeoutError):
        return f"no answer within {timeout:g} s (timeout)"
    if isinstance(reason, http.client.RemoteDisconnected):
        return "the server closed the connection without an answer"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror.lower()
    return str(reason) or type(reason).__name__


def _error_detail(e: urllib.error.HTTPError) -> str:
    """The server's own error message from a 4xx reply's body, cut to one short line."""
    try:
        body = e.read()[:2000].decode("utf-8", "replace")
    except OSError:
        return e.reason or ""
    try:
        error = json.loads(body).get("error")
        body = error.get("message", body) if isinstance(error, dict) else str(error or body)
    except (ValueError, AttributeError):
        pass
    return " ".join(str(body).split())[:300] or str(e.reason)
