"""Every saved model has a model card (README.md, Hugging Face front matter); labels name the algorithm that ran."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml
from trainer_helpers import TINY, keyword_pairs, memorise_rows, write_jsonl

from quartet.config import DPOConfig, PPOConfig, RewardConfig, SFTConfig, from_dict
from quartet.models.card import SETTINGS, add_eval, read_card
from quartet.monitor.metrics import read_metrics

pytestmark = pytest.mark.gpu  # device-sensitive: scripts/gpu_check.sh runs it on CUDA


def front_matter(model_dir) -> dict:
    text = (model_dir / "README.md").read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text[4 : text.index("\n---\n", 4)])


def assert_loads(model_dir, cls_name="AutoModelForCausalLM"):
    import transformers

    getattr(transformers, cls_name).from_pretrained(model_dir)  # the card does not get in transformers' way


@pytest.mark.parametrize("stage,cls", [("sft", SFTConfig), ("rm", RewardConfig), ("ppo", PPOConfig),
                                       ("dpo", DPOConfig)])
def test_every_setting_a_card_lists_is_a_config_field(stage, cls):
    names = {f.name for f in dataclasses.fields(cls)}
    for key in SETTINGS[stage]:
        head, *rest = key.split(".")
        assert head in names, key
        if rest:
            sub = next(f for f in dataclasses.fields(cls) if f.name == head).default_factory()
            assert rest[0] in {f.name for f in dataclasses.fields(sub)}, key


def test_sft_then_grpo_cards_chain_the_stages_and_load(tmp_path):
    from quartet.trainers.ppo import train_ppo
    from quartet.trainers.sft import train_sft

    data = write_jsonl(tmp_path / "demo.jsonl", memorise_rows())
    sft = train_sft(from_dict(SFTConfig, {
        "model": TINY, "data": {"path": str(data), "chat_template": False}, "eval_fraction": 0.25,
        "output_dir": str(tmp_path / "sft"), "max_steps": 2, "batch_size": 4, "precision": "fp32"}))
    meta = front_matter(sft.model_dir)
    assert meta["base_model"] == TINY and meta["library_name"] == "quartet" and meta["quartet_stages"] == ["sft"]
    card = (sft.model_dir / "README.md").read_text()
    assert str(data) in card and "| max_steps | 2 |" in card and "| precision | fp32 |" in card
    assert "| train loss |" in card and "| eval loss |" in card
    assert "- precision: fp32" in (tmp_path / "sft" / "summary.md").read_text()  # not accelerate's "no"
    assert_loads(sft.model_dir)

    ppo = train_ppo(from_dict(PPOConfig, {
        "policy": str(sft.model_dir), "reward": "task:tiny-target", "advantage": "grpo", "samples_per_prompt": 4,
        "prompts": {"path": "task:tiny-target/train", "max_prompt_tokens": 32},
        "output_dir": str(tmp_path / "grpo"), "iterations": 2, "rollout_batch_size": 8, "minibatch_size": 8,
        "generation": {"max_new_tokens": 4}, "precision": "fp32", "save_every": 0}), progress=False)
    meta = front_matter(ppo.model_dir)
    assert meta["base_model"] == str(sft.model_dir) and meta["quartet_stages"] == ["sft", "grpo"]
    assert {"quartet", "rlhf", "grpo"} <= set(meta["tags"]) and "ppo" not in meta["tags"]
    card = (ppo.model_dir / "README.md").read_text()
    assert "# GRPO model" in card and "task:tiny-target/train" in card and "| objective/score |" in card
    assert_loads(ppo.model_dir)
    # labels a person reads name GRPO; the record keeps stage "ppo" for code and says what ran
    assert (tmp_path / "grpo" / "summary.md").read_text().startswith("# GRPO summary")
    records = read_metrics(tmp_path / "grpo")
    assert {(r["stage"], r["algorithm"]) for r in records} == {("ppo", "grpo")}


def test_reward_and_dpo_models_have_cards(tmp_path):
    from quartet.trainers.dpo import train_dpo
    from quartet.trainers.reward import train_reward

    pairs = write_jsonl(tmp_path / "pairs.jsonl", keyword_pairs(24))
    rm = train_reward(from_dict(RewardConfig, {
        "model": TINY, "data": {"path": str(pairs)}, "output_dir": str(tmp_path / "rm"), "max_steps": 2,
        "batch_size": 8, "precision": "fp32"}))
    meta = front_matter(rm.model_dir)
    assert meta["pipeline_tag"] == "text-classification" and meta["quartet_stages"] == ["reward-model"]
    assert "| eval accuracy |" in (rm.model_dir / "README.md").read_text()
    assert_loads(rm.model_dir, "AutoModelForSequenceClassification")

    dpo = train_dpo(from_dict(DPOConfig, {
        "policy": TINY, "data": {"path": str(pairs)}, "output_dir": str(tmp_path / "ipo"), "loss": "ipo",
        "max_steps": 2, "batch_size": 4, "kl_samples": 2, "generation": {"max_new_tokens": 4},
        "precision": "fp32"}))
    meta = front_matter(dpo.model_dir)
    assert meta["quartet_stages"] == ["ipo"] and "rlhf" in meta["tags"]
    assert "| beta | 0.1 |" in (dpo.model_dir / "README.md").read_text()
    assert_loads(dpo.model_dir)


def test_add_eval_puts_one_evaluation_before_use(tmp_path):
    (tmp_path / "README.md").write_text("---\nlibrary_name: quartet\n---\n\n# M\n\n## Use\n\ncode\n")
    add_eval(tmp_path, "| a |\n|---|\n| 1 |", "first")
    add_eval(tmp_path, "| a |\n|---|\n| 2 |", "second")
    text = (tmp_path / "README.md").read_text()
    assert text.count("## Evaluation") == 1 and "| 2 |" in text and "| 1 |" not in text and "second" in text
    assert text.index("## Evaluation") < text.index("## Use") and text.endswith("code\n")
    assert read_card(tmp_path) == {"library_name": "quartet"}
    add_eval(tmp_path / "none", "t", "w")  # a folder without a card is left alone
    assert not (tmp_path / "none").exists()


def test_pipeline_puts_eval_numbers_into_the_final_models_card(tmp_path):
    from quartet.pipeline import load_pipeline, run_pipeline

    sft = write_jsonl(tmp_path / "demo.jsonl", memorise_rows())
    out = tmp_path / "run"
    (tmp_path / "pipe.yaml").write_text(json.dumps({
        "output_dir": str(out), "task": "tiny-target", "stages": ["sft", "ppo", "eval"],
        "tracking": {"report_to": "none"},
        "sft": {"model": TINY, "data": {"path": str(sft), "chat_template": False}, "eval_fraction": 0.25,
                "max_steps": 1, "batch_size": 4, "precision": "fp32"},
        "ppo": {"reward": "task:tiny-target", "advantage": "rloo", "samples_per_prompt": 4, "critic": None,
                "iterations": 1, "rollout_batch_size": 8, "minibatch_size": 8, "kl_in_reward": True,
                "generation": {"max_new_tokens": 4}, "precision": "fp32", "save_every": 0},
        "eval": {"num_prompts": 4, "max_new_tokens": 4, "batch_size": 4},
    }))
    run_pipeline(load_pipeline(str(tmp_path / "pipe.yaml")))
    card = (out / "ppo" / "model" / "README.md").read_text()
    assert "## Evaluation" in card and "| RLOO |" in card and "| SFT (baseline) |" in card
    assert "## Evaluation" not in (out / "sft" / "model" / "README.md").read_text()
    assert "| RLOO |" in (out / "summary.md").read_text()
    assert "<h3>rloo</h3>" in (out / "report.html").read_text()
