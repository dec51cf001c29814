"""The Python API (quartet.api): every kind of object it takes, rewards and their weights, presets, one-line
errors, and callbacks that watch and stop training. Tiny models, a step or an iteration each."""

from __future__ import annotations

import json
import random

import datasets
import pytest
import torch
import transformers
import yaml

import quartet
from quartet.config import PPO_PRESETS, PPOConfig
from quartet.models import load_causal_lm

TINY = "tiny:llama?hidden=32&layers=1&heads=4&vocab=260&seed=1"


def sft_rows(n: int = 8) -> list[dict]:
    rng = random.Random(0)
    return [{"prompt": f"key {i}", "completion": "".join(rng.choice("abcdefgh") for _ in range(6))} for i in range(n)]


def pair_rows(n: int = 8) -> list[dict]:
    return [{"prompt": f"q {i}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(n)]


def prompt_rows(n: int = 8) -> list[dict]:
    return [{"prompt": "".join(random.Random(i).choice("abcdefgh") for _ in range(5))} for i in range(n)]


def ppo_kwargs(tmp_path, **over) -> dict:
    """Sizes like tests/builders.py's tiny_ppo, which runs in seconds, as API keywords."""
    kw = dict(output_dir=str(tmp_path / "ppo"), iterations=1, rollout_batch_size=4, minibatch_size=4,
              micro_batch_size=4, ppo_epochs=1, generation={"max_new_tokens": 4, "batch_size": 16},
              optim={"lr": 1e-3}, precision="fp32")
    kw.update(over)
    return kw


def quartet_reward(prompts, responses):
    return [len(r) / 4.0 for r in responses]


class Counted:
    """A reward that counts its calls (how often the rollout's responses were scored)."""

    def __init__(self, fn):
        self.fn, self.calls, self.__name__ = fn, 0, fn.__name__

    def __call__(self, prompts, responses):
        self.calls += 1
        return self.fn(prompts, responses)


def trl_reward(completions, **kwargs):  # TRL's reward_funcs signature
    return [float("a" in c) for c in completions]


class StopAfterFirst(quartet.Callback):
    def __init__(self):
        self.steps, self.logs, self.saved = [], [], []

    def on_step(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)
        assert kwargs["model"] is not None and kwargs["tokenizer"] is not None
        control.should_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))

    def on_save(self, args, state, control, checkpoint=None, **kwargs):
        self.saved.append(checkpoint)


def metrics_of(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------- objects in, CLI path out
def test_sft_takes_a_loaded_model_rows_and_a_dataset_and_leaves_the_model_as_it_was(tmp_path):
    model, tok = load_causal_lm(TINY)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stop = StopAfterFirst()
    trainer = quartet.SFTTrainer(model, tokenizer=tok, train_dataset=sft_rows(),
                                 eval_dataset=datasets.Dataset.from_list(sft_rows(4)),
                                 max_steps=5, batch_size=4, optim={"lr": 1e-2, "warmup_steps": 0},
                                 output_dir=tmp_path / "sft", callbacks=[stop])
    assert trainer.config.optim.lr == 1e-2 and trainer.config.optim.schedule == "cosine"  # the dict merged in
    result = trainer.train()
    assert result.steps == 1 and stop.steps == [1]  # stopped by the callback after step 1 of 5
    assert [r["step"] for r in metrics_of(tmp_path / "sft") if "sft/loss" in r] == [1]  # logged as the last step
    assert {"sft/loss", "sft/eval_loss"} <= {k for log in stop.logs for k in log}
    assert stop.saved == [result.model_dir] and (result.model_dir / "config.json").is_file()
    saved = yaml.safe_load((tmp_path / "sft" / "config.yaml").read_text())
    assert saved["model"].startswith("memory:") and saved["data"]["path"].startswith("memory:")
    trained, _ = load_causal_lm(str(result.model_dir))
    assert any(not torch.equal(p, before[n]) for n, p in trained.named_parameters())  # it trained a copy ...
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # ... not the user's model


def test_ppo_takes_a_name_a_path_a_callable_and_dict_sub_configs(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows()))
    reward = Counted(quartet_reward)
    trainer = quartet.PPOTrainer(model=(TINY), train_dataset=prompts, reward=reward, critic="shared",
                                 **ppo_kwargs(tmp_path))
    assert trainer.config.generation.max_new_tokens == 4 and trainer.config.generation.temperature == 1.0
    result = trainer.train()
    assert result.iterations == 1 and reward.calls == 1
    assert yaml.safe_load((tmp_path / "ppo" / "config.yaml").read_text())["reward"].startswith("memory:")
    samples = [json.loads(line) for line in (tmp_path / "ppo" / "samples.jsonl").read_text().splitlines()]
    assert [s["score"] for s in samples] == pytest.approx([len(s["response"]) / 4.0 for s in samples], abs=1e-5)


def test_grpo_reward_list_with_weights_logs_each_and_optimises_the_weighted_sum(tmp_path):
    model, tok = load_causal_lm(TINY)
    first = Counted(quartet_reward)
    stop = StopAfterFirst()
    trainer = quartet.GRPOTrainer(model, processing_class=tok, reward_funcs=[first, trl_reward],
                                  reward_weights=[1.0, 0.5], train_dataset=datasets.Dataset.from_list(prompt_rows()),
                                  callbacks=[stop], **ppo_kwargs(tmp_path, iterations=3))
    assert trainer.config.advantage == "grpo" and trainer.config.samples_per_prompt == 4  # the preset's
    assert list(trainer.config.reward_terms) == ["reward_quartet_reward", "reward_trl_reward"]
    result = trainer.train()
    assert result.iterations == 1 and stop.steps == [1] and result.stopped_by == "a callback"
    assert first.calls == 1  # scored once, for the sum and for its own line
    (m,) = [r for r in metrics_of(tmp_path / "ppo") if "objective/score" in r]
    assert m["objective/score"] == pytest.approx(m["rollout/reward_quartet_reward"]
                                                 + 0.5 * m["rollout/reward_trl_reward"], abs=1e-5)
    samples = [json.loads(line) for line in (tmp_path / "ppo" / "samples.jsonl").read_text().splitlines()]
    for s in samples:
        assert s["reward_trl_reward"] == float("a" in s["response"])
        assert s["score"] == pytest.approx(len(s["response"]) / 4.0 + 0.5 * s["reward_trl_reward"], abs=1e-5)
    assert stop.logs[0]["rollout/reward_trl_reward"] == m["rollout/reward_trl_reward"]


def test_a_transformers_callback_stops_rloo(tmp_path):
    class Stop(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = True
            return control

    result = quartet.RLOOTrainer(TINY, reward="task:tiny-target", train_dataset=prompt_rows(), callbacks=[Stop],
                                 **ppo_kwargs(tmp_path, iterations=2)).train()
    assert result.iterations == 1 and result.stopped_by == "a callback"


def test_reward_and_dpo_trainers_take_rows_and_stop_on_a_callback(tmp_path):
    stop = StopAfterFirst()
    rm = quartet.RewardTrainer(TINY, train_dataset=pair_rows(), eval_dataset=pair_rows(4), max_steps=3, batch_size=4,
                               output_dir=tmp_path / "rm", callbacks=[stop]).train()
    assert rm.steps == 1 and stop.steps == [1]
    dpo = quartet.DPOTrainer(model=TINY, ref_model=TINY, train_dataset=datasets.Dataset.from_list(pair_rows()),
                             args=quartet.DPOConfig(max_steps=3, batch_size=4, kl_samples=0),
                             output_dir=tmp_path / "dpo", callbacks=[StopAfterFirst()]).train()
    assert dpo.steps == 1 and (dpo.model_dir / "config.json").is_file()


# ---------------------------------------------------------------------------- configs and presets
@pytest.mark.parametrize("cls, preset", [(quartet.GRPOConfig, "grpo"), (quartet.RLOOConfig, "rloo")])
def test_preset_configs_carry_the_papers_defaults_and_take_output_dir(cls, preset):
    cfg = cls(output_dir="elsewhere", iterations=3)
    assert isinstance(cfg, PPOConfig) and cfg.output_dir == "elsewhere" and cfg.iterations == 3
    for key, value in PPO_PRESETS[preset].items():
        if key != "output_dir":
            assert getattr(cfg, key) == value, key
    assert cls().output_dir == PPO_PRESETS[preset]["output_dir"]
    trainer = getattr(quartet, f"{preset.upper()}Trainer")(cfg)
    assert trainer.config.advantage == preset and trainer.config.output_dir == "elsewhere"


def test_a_config_of_another_stage_is_refused():
    with pytest.raises(quartet.ConfigError, match="the config must be a GRPOConfig or a dict, got PPOConfig"):
        quartet.GRPOTrainer(PPOConfig())


# ---------------------------------------------------------------------------- one-line errors, before any load
@pytest.mark.parametrize("kwargs, message", [
    ({"generation": {"max_new_tokenz": 8}}, "generation.max_new_tokenz: unknown key (did you mean 'max_new_tokens'?)"),
    ({"optim": {"lr": -1.0}}, "optim.lr: must be > 0, got -1.0"),
    ({"prompts": {"path": "p.jsonl", "limit": "ten"}}, "prompts.limit: must be an integer, got 'ten'"),
    ({"reward_funcs": [quartet_reward], "reward_weights": [1.0, 2.0]}, "reward_weights: 2 weights for 1 reward"),
    ({"reward": 3}, "reward: expected a reward spec or a callable, got int"),
    ({"model": torch.nn.Linear(2, 2)}, "policy: a loaded model needs its tokenizer"),
    ({"train_dataset": 42}, "prompts: expected a path, a list of dicts or a datasets.Dataset, got int"),
])
def test_bad_input_in_python_is_one_config_error(kwargs, message, monkeypatch):
    import quartet.models.loading as loading

    monkeypatch.setattr(loading, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(quartet.ConfigError) as e:
        quartet.PPOTrainer(**kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_reward_that_takes_neither_signature_is_refused():
    with pytest.raises(quartet.ConfigError, match=r"reward 'reward_funcs\[1\]': 'lambda' must accept \(prompts, "
                                                  r"responses\), or TRL's"):
        quartet.GRPOTrainer(reward_funcs=[quartet_reward, lambda only_one: [0.0]])


def test_a_memory_name_lives_as_long_as_its_trainer():
    from quartet.rollout.rewards import load_reward_fn

    trainer = quartet.PPOTrainer(reward=quartet_reward)
    assert load_reward_fn(trainer.config.reward)(["p"], ["abcd"]) == [1.0]
    spec = trainer.config.reward
    del trainer
    with pytest.raises(quartet.ConfigError, match="no reward by that name in this process"):
        load_reward_fn(spec)


def test_rows_that_are_not_dicts_are_a_data_error_naming_the_row():
    with pytest.raises(quartet.DataError, match=r"^data row 2: expected a dict, got str$"):
        quartet.SFTTrainer(TINY, train_dataset=[{"prompt": "a", "completion": "b"}, "oops"])


def test_rows_in_memory_go_through_the_stage_checks():
    from quartet.data import load_sft

    trainer = quartet.SFTTrainer(TINY, train_dataset=datasets.Dataset.from_list([{"prompt": "a", "answer": "b"}]))
    with pytest.raises(quartet.DataError, match=r"memory:dataset\.\d+ row 1"):
        load_sft(trainer.config.data)
