"""Built-in tasks: shipped files match their builders, judges score as documented, tiny-target is learnable."""

import fnmatch
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import quartet
from quartet.data import encode_prompts, left_pad
from quartet.errors import DataError
from quartet.judges import vader_score
from quartet.tasks import cli, get_task, list_tasks
from quartet.tasks.positive_review import build as pr_build
from quartet.tasks.tiny_target import build as tt_build

ROOT = Path(__file__).resolve().parents[2]


def test_registry():
    assert list_tasks() == ["arithmetic", "constraints", "positive-review", "tiny-target"]
    for name in list_tasks():
        task = get_task(name)
        assert task.name == name and task.description and callable(task.judge)
        for split in task.splits:
            assert task.split_path(split).is_file()
    with pytest.raises(DataError, match="did you mean 'tiny-target'"):
        get_task("tiny_target")


@pytest.mark.parametrize("name,builder", [("positive-review", pr_build), ("tiny-target", tt_build)])
def test_shipped_files_are_what_the_builder_writes(name, builder):
    task = get_task(name)
    built = builder.build()
    assert set(built) == set(task.splits)
    for split, rows in built.items():
        assert task.rows(split) == rows, f"{name}/{split} differs from build.py; rerun it"


def test_positive_review_splits():
    task = get_task("positive-review")
    train, eval_ = task.prompts("train"), task.prompts("eval")
    assert len(train) >= 300 and len(eval_) >= 64
    assert len(set(train)) == len(train) and not set(train) & set(eval_)
    eval_titles = pr_build.TITLES[-pr_build.N_EVAL_TITLES :]
    assert all(any(t in p for t in eval_titles) for p in eval_)
    assert not any(t in p for t in eval_titles for p in train)
    sft = task.rows("sft")
    assert 100 <= len(sft) <= 200 and all(r["prompt"] in train for r in sft)


def test_positive_review_openings_do_not_decide_the_sentiment():
    scores = vader_score(get_task("positive-review").prompts("train"))
    assert abs(statistics.fmean(scores)) < 0.1
    assert 0.05 < sum(s > 0.5 for s in scores) / len(scores) < 0.25
    assert 0.05 < sum(s < -0.5 for s in scores) / len(scores) < 0.25


def test_positive_review_sft_demonstrations_are_mixed():
    rows = get_task("positive-review").rows("sft")
    by_kind = {}
    for row, score in zip(rows, vader_score([r["completion"] for r in rows])):
        by_kind.setdefault(row["sentiment"], []).append(score)
    assert {k: len(v) for k, v in by_kind.items()} == {"positive": 66, "negative": 66, "neutral": 66}
    assert min(by_kind["positive"]) > 0.3 and max(by_kind["negative"]) < -0.3
    assert all(abs(s) < 0.05 for s in by_kind["neutral"])
    assert all(r["completion"].count(".") + r["completion"].count("!") <= 2 for r in rows)  # short


def test_positive_review_judge():
    judge = get_task("positive-review").judge
    good, bad, flat, empty = judge(["p"] * 4, ["A wonderful, moving film. I loved it!", "Dull and awful.",
                                              "It is a film.", ""])
    assert good > 0.8 and bad < -0.5 and flat == 0.0 and empty == 0.0


def test_tiny_target_judge_reads_decoded_text():
    judge = get_task("tiny-target").judge
    assert judge(["x"] * 4, ["aaaa", "abab", "", "\ufffda"]) == [1.0, 0.5, 0.0, 0.5]
    prompts = get_task("tiny-target").prompts("train")
    assert all(4 <= len(p) <= 8 and "a" not in p for p in prompts)


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, and many times faster than two on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tiny_target_is_learned_by_a_tiny_byte_model_in_seconds(one_thread):
    """REINFORCE with a batch-mean baseline on a random-init 2-layer model reaches a mean score of 0.8
    in about 20 steps (11-21 over seeds 0-4; ~2 s)."""
    from quartet.models.tiny import build_tiny

    torch.manual_seed(0)
    model, tok = build_tiny("tiny:llama?hidden=32&layers=2&heads=4")
    task = get_task("tiny-target")
    prompts = task.prompts("train")
    enc = encode_prompts(tok, prompts, max_prompt_tokens=64)
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    batch, new_tokens, scores = 16, 6, []
    for _ in range(60):
        rows = torch.randint(len(prompts), (batch,)).tolist()
        ids, mask = left_pad([enc.input_ids[i] for i in rows], tok.pad_token_id)
        P = ids.shape[1]  # noqa: N806 (legend: P = prompt length)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0,
                                 max_new_tokens=new_tokens, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)
        responses = out[:, P:]  # (B, R)
        texts = tok.batch_decode(responses, skip_special_tokens=True)
        score = torch.tensor(task.judge([prompts[i] for i in rows], texts))
        scores.append(score.mean().item())
        if scores[-1] >= 0.8:
            break
        eos = (responses == tok.eos_token_id).long()
        response_mask = ((eos.cumsum(1) - eos) == 0).float()  # (B, R), includes the EOS token
        logits = model(input_ids=out, attention_mask=torch.cat([mask, response_mask.long()], 1)).logits
        logprobs = torch.log_softmax(logits[:, P - 1 : -1].float(), -1).gather(-1, responses[..., None])[..., 0]
        advantages = (score - score.mean()) / (score.std() + 1e-6)
        loss = -((logprobs * response_mask).sum(1) * advantages).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert scores[-1] >= 0.8, f"score after {len(scores)} steps: {scores[-1]:.2f} (start {scores[0]:.2f})"
    assert scores[0] < 0.1


def test_cli_lists_tasks_splits_and_row_counts(capsys):
    assert cli(None) == 0
    out = capsys.readouterr().out
    assert "positive-review" in out and "tiny-target" in out
    assert "train (480 rows), eval (96 rows), sft (198 rows)" in out
    assert "train (256 rows), eval (64 rows)" in out


def test_quartet_tasks_command():
    out = subprocess.run([sys.executable, "-m", "quartet.cli", "tasks"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "positive-review" in out.stdout and "tiny-target" in out.stdout


def test_package_data_ships_task_files():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["quartet"]
    pkg = Path(quartet.__file__).parent
    shipped = [p for p in (pkg / "tasks").rglob("*") if p.suffix in (".jsonl", ".md")]
    assert any(p.name == "README.md" for p in shipped) and len(shipped) >= 6
    for path in shipped:
        rel = path.relative_to(pkg).as_posix()
        assert any(fnmatch.fnmatch(rel, pat) for pat in patterns), f"{rel} is not in package-data"
    for task in map(get_task, list_tasks()):
        for split in task.splits:
            json.loads(task.split_path(split).read_text().splitlines()[0])
