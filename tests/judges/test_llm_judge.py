"""The `llm:` judge on tiny random models: the verdict tokens it reads, against a slow reference; both orders under
each rule and the position-bias count; batched equal to one by one; the pointwise rating 1-9; the dtype; the cut to
the context; ranking by wins; the rubric; the settings' checks. Judges held to a float64 reference run in fp32
(dtype "fp32"): "auto" is bf16 on a CPU with AVX-512 BF16, whose rounding (8 bits of mantissa) is far past TOL.

Tolerance of batched against one by one (and against the unpadded reference). A row's tokens, their positions and
the keys they attend to are the same in any batch (left padding is masked out, positions count real tokens only),
so the two differ only in the order fp32 sums are taken in (matrix kernels block by the batch's shape). Each value
on the way to a logit is a sum of n <= 512 terms (the context in attention, 4H = 128 in the MLP, V <= 264 in the
log-softmax) of size <= 1 (RMS-normed activations times weights initialised at std 0.02): a sum taken in another
order differs by at most lambda sqrt(n) u = 10 x 23 x 6e-8 = 1.4e-5 of its scale with probability 1 - 2e-22
(Higham and Mary 2019, as tests/equivalence.py argues), and about six such sums lie in sequence from the embedding
to the log-odds (two layers' attention and MLP, the head, the log-softmax): TOL = 1e-4 covers them on any summation
order (AVX-512 or AVX2), and is still far below what a wrong read would be off by (these rows' verdicts differ by
~5e-3, two tokens' log-probs at the verdict position by ~0.1).
"""

from __future__ import annotations

import math

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from quartet import handles
from quartet.config import EvalConfig, LabelConfig, LLMJudgeConfig, from_dict, validate
from quartet.errors import ConfigError, ModelError
from quartet.judges.llm import DEFAULT_RUBRIC, cache_file, load_llm_judge, read_rubric
from quartet.judges.llm_http import OpenAIJudge
from quartet.judges.llm_local import CUT, Float32Head, LocalLLMJudge, water_level
from quartet.judges.pairwise import all_pairs, judge_both_orders, prompt_text, rank_by_wins
from quartet.models import load_causal_lm, save_model
from quartet.models.precision import generation_dtype, precision_name
from quartet.models.tiny import CHAT_TEMPLATE, SPECIALS, build_tiny
from quartet.tasks import get_task

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA

TOL = 1e-4  # argued in the module docstring
TINY = "tiny:llama?hidden=32&layers=2&heads=4&vocab=264&seed=3"
PROMPTS = ["abc", "tell me about x", "q", "a longer prompt with some more words in it", "zz"]
FIRSTS = ["aaa0", "hello", "a", "9a9a9a9a", ""]
SECONDS = ["bcd", "hello!", "a0a0a0a0a0a0", "b", "zzz"]


@pytest.fixture(scope="module")
def judge():
    return LocalLLMJudge(TINY, "- short\n- a and digits", "pairwise", batch_size=3, dtype="fp32")


@pytest.fixture(scope="module")
def rater():
    return LocalLLMJudge(TINY, "- short", "pointwise", batch_size=3, dtype="fp32")


def _logprobs(model, ids: list[int]) -> torch.Tensor:
    """The slow reference: one unpadded row, default positions, float64 log-softmax at every position."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=next(model.parameters()).device)).logits[0]
    return torch.log_softmax(logits.double(), dim=-1).cpu()


# --------------------------------------------------------------------------- verdict tokens, pairwise
def test_the_prompt_follows_the_chat_template(judge):
    text = judge._text("the prompt", "first answer", "second answer")
    assert text.startswith("<|im_start|>system\nYou judge answers to a prompt by these principles:\n- short\n")
    assert "<|im_start|>user\n" in text and "Answer A:\nfirst answer\n\nAnswer B:\nsecond answer" in text
    assert text.endswith("Reply with one letter: A or B.<|im_end|>\n<|im_start|>assistant\n")


def test_verdict_tokens_and_log_odds_match_a_slow_reference(judge):
    # the byte-level tiny tokenizer writes "A" as one token and " A" as two (space, A): only the bare letter counts
    tok = judge.tokenizer
    assert judge.a_ids == [tok.convert_tokens_to_ids("A")] and judge.b_ids == [tok.convert_tokens_to_ids("B")]
    got = judge.compare(PROMPTS, FIRSTS, SECONDS)
    for p, f, s, value in zip(PROMPTS, FIRSTS, SECONDS, got):
        lp = _logprobs(judge.model, tok(judge._text(p, f, s), add_special_tokens=False)["input_ids"])[-1]
        assert value == pytest.approx((lp[judge.a_ids[0]] - lp[judge.b_ids[0]]).item(), abs=TOL)
    assert len(set(round(v, 4) for v in got)) > 1  # the verdicts depend on the rows


def test_batched_equals_one_by_one(judge):
    batched = judge.compare(PROMPTS, FIRSTS, SECONDS)
    single = [judge.compare([p], [f], [s])[0] for p, f, s in zip(PROMPTS, FIRSTS, SECONDS)]
    assert batched == pytest.approx(single, abs=TOL)


def test_both_orders_with_the_model(judge):
    verdicts = judge_both_orders(judge, PROMPTS, FIRSTS, SECONDS)
    assert verdicts.ab == pytest.approx(judge.compare(PROMPTS, FIRSTS, SECONDS), abs=TOL)
    assert verdicts.ba == pytest.approx(judge.compare(PROMPTS, SECONDS, FIRSTS), abs=TOL)
    n = len(PROMPTS)
    biased = sum((a > 0) == (b > 0) for a, b in zip(verdicts.ab, verdicts.ba)) / n
    assert verdicts.position_bias == pytest.approx(biased) and verdicts.ties == pytest.approx(biased)


# --------------------------------------------------------------------------- both orders, ranks (hand-worked)
class Scripted:
    """A judge that answers each compare() call with the next list of log-odds, and records what it was asked."""

    name = "scripted"

    def __init__(self, *answers):
        self.answers, self.asked = list(answers), []

    def compare(self, prompts, firsts, seconds):
        self.asked.append((list(prompts), list(firsts), list(seconds)))
        return self.answers.pop(0)


def test_both_orders_count_position_bias_and_ties():
    ab, ba = [2.0, 1.0, 1.0, -1.0, 0.1], [-2.0, 1.0, 0.05, 1.0, -0.3]
    a, b = list("abcde"), list("vwxyz")
    # margin 0.2: row 0 a wins both orders; row 1 "first" wins both: the position decided, a biased tie; row 2 the
    # second order within the margin: a tie, not biased; row 3 b wins both; row 4 the first order within the margin
    judge = Scripted(ab, ba)
    v = judge_both_orders(judge, ["p"] * 5, a, b, tie_margin=0.2)
    assert judge.asked == [(["p"] * 5, a, b), (["p"] * 5, b, a)]  # one call per order, all rows in it
    assert (v.winner, v.ab, v.ba) == ([1, 0, 0, -1, 0], ab, ba)
    assert (v.position_bias, v.ties) == (pytest.approx(1 / 5), pytest.approx(3 / 5))
    # margin 0: row 2 is now the first position twice (biased), row 4 a win for a in both orders
    v = judge_both_orders(Scripted(ab, ba), ["p"] * 5, a, b)
    assert (v.winner, v.position_bias, v.ties) == ([1, 0, 0, -1, 1], pytest.approx(2 / 5), pytest.approx(2 / 5))


def test_average_rule_keeps_a_position_biased_judges_preference():
    """orders: average (RLAIF): the pair's log-odds (ab - ba) / 2. A judge that picks the first position in nearly
    every pair (SmolLM2-135M's +2.1..+2.7 both ways) gives agree only ties; the mean keeps the lean left over."""
    ab, ba = [2.7, 2.1, 2.5, -0.4, 0.3], [2.1, 2.7, 2.5, -1.0, -0.1]
    a, b = list("abcde"), list("vwxyz")
    # margin 0.1. means: (2.7 - 2.1) / 2 = 0.3 a; (2.1 - 2.7) / 2 = -0.3 b; 0 a tie; (-0.4 + 1.0) / 2 = 0.3 a;
    # (0.3 + 0.1) / 2 = 0.2 a. Rows 0-2 went to the first position twice, row 3 to the second twice: bias 4/5;
    # row 4's second verdict is inside the margin (undecided, not biased)
    judge = Scripted(ab, ba)
    v = judge_both_orders(judge, ["p"] * 5, a, b, tie_margin=0.1, rule="average")
    assert judge.asked == [(["p"] * 5, a, b), (["p"] * 5, b, a)]
    assert (v.winner, v.ab, v.ba) == ([1, -1, 0, 1, 1], ab, ba)
    assert (v.position_bias, v.ties) == (pytest.approx(4 / 5), pytest.approx(1 / 5))
    # agree on the same verdicts: every pair a tie, the same position bias
    v = judge_both_orders(Scripted(ab, ba), ["p"] * 5, a, b, tie_margin=0.1)
    assert (v.winner, v.position_bias, v.ties) == ([0] * 5, pytest.approx(4 / 5), 1.0)
    # margin 0.35: every mean inside it
    v = judge_both_orders(Scripted(ab, ba), ["p"] * 5, a, b, tie_margin=0.35, rule="average")
    assert (v.winner, v.ties) == ([0] * 5, 1.0)
    # pointwise judges give ba = -ab: the two rules agree
    v = judge_both_orders(Scripted([1.5, -0.5, 0.0], [-1.5, 0.5, 0.0]), ["p"] * 3, a[:3], b[:3], rule="average")
    assert v.winner == judge_both_orders(Scripted([1.5, -0.5, 0.0], [-1.5, 0.5, 0.0]), ["p"] * 3, a[:3],
                                         b[:3]).winner == [1, -1, 0]
    with pytest.raises(ValueError, match="rule must be one of agree, average, got 'mean'"):
        judge_both_orders(Scripted([], []), [], [], [], rule="mean")


def test_chat_prompts_are_read_as_one_text():
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes?"},
            {"role": "user", "content": "review this"}]
    assert prompt_text(chat) == "user: hi\nassistant: yes?\nuser: review this"
    judge = Scripted([1.0], [-1.0])
    judge_both_orders(judge, [chat], ["a"], ["b"])
    assert judge.asked[0][0] == ["user: hi\nassistant: yes?\nuser: review this"]


def test_rank_by_wins_hand_worked():
    assert all_pairs(3) == [(0, 1), (0, 2), (1, 2)]
    # 0 beats 1, 0 ties 2, 2 beats 1: 0 has 1 + 0.5 of 2 pairs, 1 none, 2 has 0.5 + 1
    assert rank_by_wins(3, [1, 0, -1]) == [0.75, 0.0, 0.75]
    # a strict order of 4: 3 > 2 > 1 > 0 gives win shares 0, 1/3, 2/3, 1
    winners = [1 if i > j else -1 for i, j in all_pairs(4)]
    assert rank_by_wins(4, winners) == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0])
    assert rank_by_wins(4, [0] * 6) == [0.5] * 4
    assert sum(rank_by_wins(5, [1, -1, 0, 1, 0, 0, -1, 1, 1, -1])) * 4 == pytest.approx(10)  # one win per pair
    assert rank_by_wins(1, []) == [0.5]
    with pytest.raises(ValueError, match="3 answers make 3 pairs, got 2"):
        rank_by_wins(3, [1, 1])


# --------------------------------------------------------------------------- pointwise
def _expected_rating(model, tok, ids: list[int]) -> float:
    """Slow reference of the rating: p(r) of the tokens "1" ... "9" at the last position, renormalised."""
    first = _logprobs(model, ids)[-1].exp()
    p = [first[tok.convert_tokens_to_ids(str(r))].item() for r in range(1, 10)]
    return sum((r + 1) * x for r, x in enumerate(p)) / sum(p)


def test_pointwise_rating_matches_a_slow_reference(rater):
    tok = rater.tokenizer
    assert rater.digit_ids == [tok.convert_tokens_to_ids(str(r)) for r in range(1, 10)]
    assert rater._text("p", "x", None).endswith("Reply with one digit from 1 to 9.<|im_end|>\n<|im_start|>assistant\n")
    scores = rater.score(PROMPTS, FIRSTS)
    for p, a, s in zip(PROMPTS, FIRSTS, scores):
        ref = _expected_rating(rater.model, tok, tok(rater._text(p, a, None), add_special_tokens=False)["input_ids"])
        assert 1 <= s <= 9 and s == pytest.approx(ref, abs=TOL)
    rater._memo.clear()
    single = [rater.score([p], [a])[0] for p, a in zip(PROMPTS, FIRSTS)]
    assert scores == pytest.approx(single, abs=TOL)
    # a pair: the difference of the two ratings, so the two orders are exact opposites
    ab, ba = rater.compare(PROMPTS, FIRSTS, SECONDS), rater.compare(PROMPTS, SECONDS, FIRSTS)
    assert ab == pytest.approx([x - y for x, y in zip(scores, rater.score(PROMPTS, SECONDS))], abs=TOL)
    assert ab == [-x for x in ba]


def _merged_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny byte-level tokenizer with three merges: " A", " B" and "10" become one token each."""
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for merged in ("ĠA", "ĠB", "10"):
        vocab[merged] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "A"), ("Ġ", "B"), ("1", "0")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=SPECIALS[0], eos_token=SPECIALS[3],
                                  additional_special_tokens=SPECIALS[1:3])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_spaced_letters_and_a_one_token_ten_left_unread():
    """A vocabulary with " A" and "10" as tokens: both spellings of a letter count (their probabilities summed), and
    the rating reads the digits 1-9 only, "10" being no rating on the scale asked for."""
    model, _ = build_tiny(TINY)
    tok = _merged_tokenizer()
    name = handles.register("model", (model, tok), "merged")
    pair = LocalLLMJudge(name, "- r", "pairwise", dtype="fp32")
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("A", "ĠA", "B", "ĠB", "10")}
    assert (pair.a_ids, pair.b_ids) == ([ids["A"], ids["ĠA"]], [ids["B"], ids["ĠB"]])
    lp = _logprobs(pair.model, tok(pair._text("p", "x", "y"), add_special_tokens=False)["input_ids"])[-1]
    ref = torch.logsumexp(lp[[ids["A"], ids["ĠA"]]], 0) - torch.logsumexp(lp[[ids["B"], ids["ĠB"]]], 0)
    assert pair.compare(["p"], ["x"], ["y"])[0] == pytest.approx(ref.item(), abs=TOL)

    rate = LocalLLMJudge(name, "- r", "pointwise", dtype="fp32")
    assert ids["10"] not in rate.digit_ids and len(rate.digit_ids) == 9
    ref = _expected_rating(rate.model, tok, tok(rate._text("p", "x", None), add_special_tokens=False)["input_ids"])
    assert rate.score(["p"], ["x"])[0] == pytest.approx(ref, abs=TOL)


NO_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
             "{% endif %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""a chat template that refuses a system message, as Gemma's does"""


def test_no_chat_template_and_no_system_role():
    model, tok = build_tiny(TINY)
    tok.chat_template = None
    plain = LocalLLMJudge(handles.register("model", (model, tok), "plain"), "- r")
    text = plain._text("p", "x", "y")
    assert text.startswith("You judge answers") and text.endswith("Reply with one letter: A or B.\n\nVerdict:\n")
    assert math.isfinite(plain.compare(["p"], ["x"], ["y"])[0])

    model, tok = build_tiny(TINY)
    tok.chat_template = NO_SYSTEM
    merged = LocalLLMJudge(handles.register("model", (model, tok), "nosys"), "- r")
    text = merged._text("p", "x", "y")
    assert not merged.system_role and "<|im_start|>system" not in text
    assert text.startswith("<|im_start|>user\nYou judge answers to a prompt by these principles:\n- r\n\nWhich")


def test_a_verdict_that_merges_with_the_prompt_is_refused():
    one = LocalLLMJudge(TINY, "- r")
    one._encode = lambda texts: [[5, 6]] + [[5, 7, 8]] * (len(texts) - 1)  # appending re-tokenises the probe's end
    with pytest.raises(ModelError, match="writes the verdict 'A' as more than one token after the judge prompt"):
        one._letter_ids("probe", "A")


# --------------------------------------------------------------------------- dtype
def test_dtype_is_in_the_name_so_fp32_and_bf16_verdicts_never_mix(tmp_path):
    """bf16 weights, a float32 log-softmax: verdicts within bf16's rounding of fp32's; "auto" resolves as the
    samplers' dtype does. The cache keys hold the dtype: a bf16 judge reads none of an fp32 judge's verdicts."""
    bf16 = LocalLLMJudge(TINY, "- r", dtype="bf16")
    assert bf16.model.get_input_embeddings().weight.dtype == torch.bfloat16 and "|bf16|" in bf16.name
    head = bf16.model.get_output_embeddings()  # float32 (Float32Head): logits not rounded to bf16's 8 bits
    assert isinstance(head, Float32Head) and head.weight.dtype == torch.float32
    assert torch.equal(head.weight.cpu(), load_causal_lm(TINY, torch.bfloat16)[0].lm_head.weight.float())  # cast exactly
    auto = LocalLLMJudge(TINY, "- r")
    assert auto.dtype == precision_name("auto") and next(auto.model.parameters()).dtype == generation_dtype("auto")
    fp32 = LocalLLMJudge(TINY, "- r", dtype="fp32")
    assert fp32.name == bf16.name.replace("|bf16|", "|fp32|")
    assert type(fp32.model.get_output_embeddings()) is torch.nn.Linear
    # bf16 rounds each weight and activation by up to 2^-8 = 4e-3 of itself; these random logits are of size ~0.1,
    # so a log-odds moves by a few 1e-4 (measured 4e-4): 3e-3 bounds it, and is still below the rows' own spread
    # (their verdicts run from 0.004 to 0.018), so a bf16 judge reading the wrong rows would fail
    got, ref = bf16.compare(PROMPTS, FIRSTS, SECONDS), fp32.compare(PROMPTS, FIRSTS, SECONDS)
    assert got == pytest.approx(ref, abs=3e-3) and max(ref) - min(ref) > 6e-3
    cache = tmp_path / "verdicts.sqlite"
    first = load_llm_judge(f"llm:{TINY}", LLMJudgeConfig(dtype="fp32", batch_size=8), None, cache, "label")
    first.compare(PROMPTS, FIRSTS, SECONDS)
    other = load_llm_judge(f"llm:{TINY}", LLMJudgeConfig(dtype="bf16", batch_size=8), None, cache, "label")
    other.compare(PROMPTS, FIRSTS, SECONDS)
    assert (first.calls, other.calls, other.hits) == (len(PROMPTS), len(PROMPTS), 0)


# --------------------------------------------------------------------------- the context
GPT2 = "tiny:gpt2?hidden=32&layers=1&heads=4&vocab=260&ctx=300&seed=0"


def test_long_rows_are_cut_to_the_context_never_past_it():
    """GPT-2's learned positions end at its context: a row past it would fail with an index error, so running the
    forward at all shows every row fits. The prompt keeps its end, the answers their beginning, cuts marked."""
    judge = LocalLLMJudge(GPT2, "- r", "pairwise", batch_size=2)
    long_prompt, first, second = "P" * 150 + "question?", "start of A " + "a" * 200, "start of B " + "b" * 300
    rows = [("short", "x", "y"), (long_prompt, first, second)]
    seqs = judge._rows(rows)
    assert judge.truncated == 1 and len(seqs[1]) <= 300
    assert seqs[0] == judge._encode([judge._text(*rows[0])])[0]
    text = judge.tokenizer.decode(seqs[1])
    assert f"Prompt:\n{CUT} P" in text and "question?\n\nAnswer A:\nstart of A aaa" in text
    assert f"a {CUT}\n\nAnswer B:\nstart of B bbb" in text and f"b {CUT}\n\nReply" in text
    values = judge.compare([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
    assert all(math.isfinite(v) for v in values)

    with pytest.raises(ConfigError, match="leaves no room for the prompt and answers in the model's context of 300"):
        LocalLLMJudge(GPT2, "- " + "r" * 400).compare(["p"], ["x"], ["y"])


def test_water_level():
    assert water_level([10, 3, 50], 30) == 17  # 10 + 3 + 17 = 30: the two short parts whole, the long one cut
    assert water_level([10, 3, 50], 29) == 16
    assert water_level([10, 10], 30) == 10
    assert water_level([5, 5, 5], 2) == 0
    assert sum(min(n, water_level([7, 40, 90], 60)) for n in (7, 40, 90)) <= 60


# --------------------------------------------------------------------------- loading by spec, rubric
def test_load_by_spec_names_the_resolved_model_and_caches(tmp_path):
    model, tok = build_tiny(TINY)
    save_model(model, tok, tmp_path / "judge-model")
    cfg = LLMJudgeConfig(batch_size=4)
    spec = f"llm:{tmp_path / 'judge-model'}"
    cache = cache_file("auto", tmp_path / "out")
    assert cache == tmp_path / "out" / "verdicts.sqlite"
    first = load_llm_judge(spec, cfg, get_task("tiny-target").rubric, cache, "label")
    assert first.name.startswith(f"llm:{tmp_path / 'judge-model'}|local|pairwise|")
    assert str((tmp_path / "judge-model").resolve()) in first.name
    assert first.rubric == get_task("tiny-target").rubric
    values = first.compare(PROMPTS, FIRSTS, SECONDS)
    again = load_llm_judge(spec, cfg, get_task("tiny-target").rubric, cache, "label")
    assert again.compare(PROMPTS, FIRSTS, SECONDS) == values
    assert (first.calls, again.calls, again.hits) == (len(PROMPTS), 0, len(PROMPTS))
    assert cache_file(None, tmp_path) is None and cache_file("my.sqlite", tmp_path).name == "my.sqlite"


def test_load_picks_the_openai_backend_by_base_url(monkeypatch):
    checked = []
    monkeypatch.setattr(OpenAIJudge, "check", lambda self, where=None: checked.append(self.base_url))
    monkeypatch.setenv("MY_JUDGE_KEY", "secret")
    cfg = LLMJudgeConfig(base_url="http://127.0.0.1:8000/v1", api_key_env="MY_JUDGE_KEY", mode="pointwise",
                         cache=None)
    judge = load_llm_judge("llm:served-model", cfg, None, None, "eval")
    assert isinstance(judge.judge, OpenAIJudge) and judge.cache is None and checked == ["http://127.0.0.1:8000/v1"]
    assert (judge.judge.model, judge.judge.api_key, judge.judge.mode) == ("served-model", "secret", "pointwise")
    assert judge.name.startswith("llm:served-model|openai|pointwise")
    assert judge.rubric == DEFAULT_RUBRIC


def test_load_refuses_a_bad_spec_and_an_unreachable_server(tmp_path):
    with pytest.raises(ConfigError, match=r"^label.judge: must be llm:<model>"):
        load_llm_judge("llm: ", LLMJudgeConfig(), None, None, "label")
    cfg = LLMJudgeConfig(base_url="http://127.0.0.1:9/v1", timeout=5)  # auto: a base_url means the openai backend
    with pytest.raises(ConfigError, match=r"^label.llm_judge.base_url: cannot reach http://127.0.0.1:9/v1/models"):
        load_llm_judge("llm:some-model", cfg, None, None, "label")


def test_rubric_text_file_default_and_errors(tmp_path):
    assert read_rubric(None, None, "label.llm_judge") == DEFAULT_RUBRIC
    assert read_rubric(None, "- the task's", "label.llm_judge") == "- the task's"
    assert read_rubric("  be kind \n\n be brief ", "- the task's", "x") == "be kind\nbe brief"
    path = tmp_path / "rubric.md"
    path.write_text("\ufeff- one\n\n   - two  \n", encoding="utf-8")
    assert read_rubric(str(path), None, "x") == "- one\n- two"
    with pytest.raises(ConfigError, match=r"^label.llm_judge.rubric: .*missing.txt: no such file"):
        read_rubric(str(tmp_path / "missing.txt"), None, "label.llm_judge")
    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(ConfigError, match=r"^eval.llm_judge.rubric: .*empty.txt is empty"):
        read_rubric(str(tmp_path / "empty.txt"), None, "eval.llm_judge")
    (tmp_path / "dir.txt").mkdir()
    with pytest.raises(ConfigError, match=r"^x.rubric: .*dir.txt is not a regular file"):
        read_rubric(str(tmp_path / "dir.txt"), None, "x")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ConfigError, match=r"^x.rubric: .*bin.txt is not UTF-8 text"):
        read_rubric(str(tmp_path / "bin.txt"), None, "x")


def test_built_in_tasks_have_rubrics():
    assert "positive, well-written movie review" in get_task("positive-review").rubric
    assert "same film" in get_task("positive-review").rubric
    assert get_task("tiny-target").rubric


# --------------------------------------------------------------------------- settings
@pytest.mark.parametrize("settings, message", [
    ({"timeout": 0}, "label.llm_judge.timeout: must be > 0"),
    ({"max_retries": -1}, "label.llm_judge.max_retries: must be >= 0"),
    ({"max_in_flight": 0}, "label.llm_judge.max_in_flight: must be > 0"),
    ({"batch_size": 0}, "label.llm_judge.batch_size: must be > 0"),
    ({"backend": "openai"}, "label.llm_judge.base_url: the openai backend needs the server's URL"),
    ({"backend": "local", "base_url": "http://h/v1"}, "label.llm_judge.base_url: is set but backend is local"),
    ({"base_url": "ftp://h/v1"}, "label.llm_judge.base_url: must be an http:// or https:// URL"),
    ({"api_key_env": "MY KEY"}, "label.llm_judge.api_key_env: must be the name of an environment variable"),
    ({"rubric": "  "}, "label.llm_judge.rubric: must be the principles' text or a file path"),
    ({"cache": ""}, "label.llm_judge.cache: must be \"auto\", a file path or null"),
    ({"mode": "ranking"}, "label.llm_judge.mode: must be one of 'pairwise', 'pointwise'"),
    ({"backend": "vllm"}, "label.llm_judge.backend: must be one of 'auto', 'local', 'openai'"),
    ({"orders": "mean"}, "label.llm_judge.orders: must be one of 'agree', 'average'"),
    ({"dtype": "fp16"}, "label.llm_judge.dtype: must be one of 'auto', 'bf16', 'fp32'"),
])
def test_settings_are_checked(settings, message):
    with pytest.raises(ConfigError) as e:
        validate(from_dict(LabelConfig, {"llm_judge": settings}, "label"), "label")
    assert str(e.value).startswith(message)


def test_settings_defaults_and_eval():
    cfg = LLMJudgeConfig()
    assert (cfg.mode, cfg.resolved_backend, cfg.cache) == ("pairwise", "local", "auto")
    assert LLMJudgeConfig(base_url="http://h/v1").resolved_backend == "openai"
    EvalConfig(judge="llm:smollm2-135m-instruct").validate("eval")
    with pytest.raises(ConfigError, match=r"^eval.judge: must be llm:<model>"):
        EvalConfig(judge="task:positive-review").validate("eval")
    with pytest.raises(ConfigError, match=r"^llm_judge.timeout: must be > 0"):
        EvalConfig(llm_judge=LLMJudgeConfig(timeout=-1)).validate()
    assert (cfg.orders, cfg.dtype) == ("agree", "auto")
    with pytest.raises(ConfigError, match=r"^eval.llm_judge.orders: must be one of agree, average, got 'both'"):
        LLMJudgeConfig(orders="both").validate("eval.llm_judge")
    with pytest.raises(ConfigError, match=r"^eval.llm_judge.dtype: must be one of auto, bf16, fp32, got 'float16'"):
        LLMJudgeConfig(dtype="float16").validate("eval.llm_judge")


def test_a_loaded_tiny_model_and_the_judge_agree_on_the_pad_token():
    """The judge pads with the loader's pad token (never EOS), so a padded row cannot read a pad as a real token."""
    _, tok = load_causal_lm(TINY)
    assert tok.pad_token_id != tok.eos_token_id and tok.padding_side == "left"
