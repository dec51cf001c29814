"""rm.group_by_prompt (InstructGPT's fix): batches of whole prompt groups, each group weighing the same in the loss;
off by default, with the batching of before."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from trainer_helpers import TINY, single_thread, write_jsonl  # noqa: F401

from quartet.config import from_dict
from quartet.config.stages import RewardConfig
from quartet.trainers import loop, reward
from quartet.trainers.reward import _Collate, bradley_terry_loss, group_weights, train_reward

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA


def test_group_batches_hold_whole_groups_and_every_row_once_per_epoch():
    sizes = [3, 1, 6, 2, 2, 5, 1, 4]  # 6 and 5 pairs: alone in a batch of at most 4, the rest packed up to 4
    groups = [g for g, n in enumerate(sizes) for _ in range(n)]
    batches = loop.GroupBatches(groups, max_rows=4, seed=0)
    epochs = []
    for _ in range(3):
        expected = len(batches)
        epoch = list(batches)
        assert len(epoch) == expected
        assert sorted(i for b in epoch for i in b) == list(range(len(groups)))  # every row once
        for b in epoch:
            touched = Counter(groups[i] for i in b)
            assert all(touched[g] == sizes[g] for g in touched)  # all of each group it touches
            assert len(b) <= 4 or len(touched) == 1  # a group above the cap is alone
        epochs.append(epoch)
    assert epochs[0] != epochs[1]  # reshuffled by group each epoch
    again = loop.GroupBatches(groups, max_rows=4, seed=0)
    assert [list(again) for _ in range(3)] == epochs  # same seed, same batches


def test_group_weights_and_the_weighted_loss_by_hand():
    # two groups in the batch: "a" with 1 pair, "b" with 3 -> 1/2 for a's pair, 1/6 for each of b's
    w = group_weights(["a", "b", "b", "b"])
    torch.testing.assert_close(w, torch.tensor([1 / 2, 1 / 6, 1 / 6, 1 / 6]))
    rc, rr = torch.tensor([1.0, 0.0, 0.0, 2.0]), torch.zeros(4)
    l1, l0 = math.log1p(math.exp(-1.0)), math.log(2.0)  # -log sigmoid(1), -log sigmoid(0)
    l2 = math.log1p(math.exp(-2.0))
    per_group = (l1 + (l0 + l0 + l2) / 3) / 2  # mean over groups of each group's mean: InstructGPT's per-prompt loss
    per_pair = (l1 + l0 + l0 + l2) / 4
    assert bradley_terry_loss(rc, rr, weight=w).item() == pytest.approx(per_group)
    assert bradley_terry_loss(rc, rr).item() == pytest.approx(per_pair)
    # centering weighted the same way: 0.1 * (1/2 * 1 + 1/6 * (0 + 0 + 4))
    assert bradley_terry_loss(rc, rr, center_coef=0.1, weight=w).item() == pytest.approx(per_group + 0.1 * (0.5 + 4 / 6))


def test_collate_adds_weights_only_to_rows_that_carry_a_group():
    rows = [([5, 6], [7], 0.0), ([5], [8, 9], 1.0)]
    plain = _Collate(0)(rows)
    assert set(plain) == {"input_ids", "attention_mask", "margin"}
    grouped = _Collate(0)([(*r, g) for r, g in zip(rows, ["p", "q"])])
    for key in plain:
        torch.testing.assert_close(grouped[key], plain[key])
    torch.testing.assert_close(grouped["weight"], torch.tensor([0.5, 0.5]))


def _ranked_pairs(n_prompts: int = 8, k: int = 4) -> list[dict]:
    """Each prompt's K answers ranked by how many times they say `yes`: K(K-1)/2 pairs per prompt."""
    rows = []
    for p in range(n_prompts):
        answers = [f"answer {p}:" + " yes" * j + " no" * (k - j) for j in range(k)]
        rows += [{"prompt": f"prompt {p}", "chosen": answers[j], "rejected": answers[i]}
                 for i in range(k) for j in range(i + 1, k)]
    return rows


def _cfg(tmp_path, **fields) -> RewardConfig:
    data = write_jsonl(tmp_path / "pairs.jsonl", _ranked_pairs())
    return from_dict(RewardConfig, {
        "model": TINY, "data": {"path": str(data)}, "eval_fraction": 0.0, "output_dir": str(tmp_path / "rm"),
        "max_steps": 6, "batch_size": 8, "optim": {"lr": 1e-3, "warmup_steps": 1}, "log_every": 3,
        "eval_every": 100, **fields,
    })


def test_rm_with_group_by_prompt_batches_whole_prompts(tmp_path, monkeypatch):
    seen = []
    collate = reward._Collate.__call__

    def record(self, rows):
        batch = collate(self, rows)
        if len(rows[0]) > 3:  # training batches carry their group
            seen.append([row[3] for row in rows])
        return batch

    monkeypatch.setattr(reward._Collate, "__call__", record)
    result = train_reward(_cfg(tmp_path, group_by_prompt=True))
    assert result.steps == 6 and math.isfinite(result.train_loss)
    assert len(seen) >= 6
    for groups in seen:  # 6 pairs per prompt, at most 8 per batch: one prompt's 6 pairs, all of them
        assert list(Counter(groups).values()) == [6]
    assert "a prompt's pairs in one batch" in (tmp_path / "rm" / "summary.md").read_text()


def test_rm_default_batching_is_the_seeded_shuffle_of_before(tmp_path, monkeypatch):
    """group_by_prompt off: the train loader is loop.make_loader's seeded shuffle of the (chosen, rejected, margin)
    rows, as before the option existed, and no batch carries weights (so the loss is the plain mean)."""
    calls = []
    make_loader = loop.make_loader

    def spy(items, batch_size, collate, shuffle, seed=0):
        calls.append((len(items[0]) if items else None, batch_size, shuffle, seed))
        return make_loader(items, batch_size, collate, shuffle, seed)

    grouped = []
    make_group_loader = loop.make_group_loader

    def group_spy(items, groups, max_rows, collate, seed, shuffle=True):
        grouped.append(shuffle)
        return make_group_loader(items, groups, max_rows, collate, seed, shuffle)

    monkeypatch.setattr(loop, "make_loader", spy)
    monkeypatch.setattr(loop, "make_group_loader", group_spy)
    train_reward(_cfg(tmp_path, max_steps=2, seed=3, eval_fraction=0.25))
    assert calls[0] == (3, 8, True, 3)  # the train loader
    assert grouped == [False]  # only the held-out loader goes a prompt at a time, in order
    assert not RewardConfig().group_by_prompt


def test_group_batches_without_shuffle_keep_the_groups_first_order():
    groups = ["a", "a", "b", "c", "c", "c", "d"]
    batches = loop.GroupBatches(groups, max_rows=3, seed=5, shuffle=False)
    assert list(batches) == [[0, 1, 2], [3, 4, 5], [6]] == list(batches)  # the same every pass


def test_held_out_pairs_go_a_prompt_at_a_time_and_score_as_one_pair_at_a_time(tmp_path):
    """The held-out loader puts a prompt's pairs in one batch, so each answer is one forward for all its pairs;
    the margins, accuracy, calibration and temperatures are those of scoring each pair in a batch of its own
    (float32: the forwards differ only in which rows share a padded chunk, ~1e-6)."""
    from quartet.data.schemas import PreferenceExample
    from quartet.models import load_reward_model

    pairs = [PreferenceExample(**r) for r in _ranked_pairs(n_prompts=3, k=4)]
    mixed = [pairs[i] for i in (0, 6, 12, 1, 7, 13, 2, 8, 14, 3, 9, 15, 4, 10, 16, 5, 11, 17)]  # prompts interleaved
    order = reward._prompt_by_prompt(loop.prompt_groups(mixed))
    ordered = [mixed[i] for i in order]
    assert [ex.prompt for ex in ordered] == [p.prompt for p in pairs]  # contiguous, in first-appearance order
    assert [ex.chosen for ex in ordered[:6]] == [p.chosen for p in pairs[:6]]  # stable within a prompt

    rm = load_reward_model(TINY, torch.float32)
    rows = reward._encode(rm.tokenizer, mixed, 64, True)
    rows, groups = [rows[i] for i in order], [loop.prompt_groups(mixed)[i] for i in order]
    seen = []
    forward = type(rm).forward

    def count(self, input_ids, attention_mask):
        seen.append(input_ids.shape[0])
        return forward(self, input_ids, attention_mask)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(rm), "forward", count)
        grouped = reward.evaluate(rm, loop.make_group_loader(rows, groups, 8, _Collate(0), 0, shuffle=False), groups)
    assert sum(seen) == 3 * 4  # each prompt's 4 answers once for its 6 pairs
    alone = reward.evaluate(rm, loop.make_loader(rows, 1, _Collate(0), shuffle=False), groups)
    assert grouped.accuracy == alone.accuracy
    assert grouped.margin == pytest.approx(alone.margin, abs=1e-5)
    assert grouped.temperature == pytest.approx(alone.temperature, rel=1e-4)
    assert grouped.fold_temperatures == pytest.approx(alone.fold_temperatures, rel=1e-4)
    assert [b["count"] for b in grouped.calibration] == [b["count"] for b in alone.calibration]
