"""Property: any YAML text, any mapping, any override gives either a valid config or a one-line ConfigError.

"Valid" is checked, not assumed: every float in an accepted config is finite, validating it again passes,
and saving it then loading the saved YAML gives the same config. Strategies draw keys from the real field
names (nested by the real sub-configs), so the examples reach the range checks and not only the
unknown-key check.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quartet.config import (
    DPOConfig,
    LabelConfig,
    PPOConfig,
    RewardConfig,
    SFTConfig,
    load_config,
    save_config,
    validate,
)
from quartet.errors import ConfigError
from quartet.pipeline import PipelineConfig, load_pipeline

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
STAGES = [SFTConfig, LabelConfig, RewardConfig, PPOConfig, DPOConfig]
_SCRATCH = tempfile.TemporaryDirectory(prefix="quartet-fuzz-config-")  # removed when the session exits
WORK = Path(_SCRATCH.name)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 0.5, 1e-8, 2**32, ".nan", "nan", ".inf", "inf", "1e-4", "3e999", "", "auto",
                     "task:tiny-target/train", "tiny:llama", "all-linear", "fp32", "left", "cosine"]),
    st.text(max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)


def mapping_for(cls: type, depth: int = 0) -> st.SearchStrategy[dict]:
    """Mappings over `cls`'s own field names (plus the odd stranger), nested for sub-config fields."""
    hints = typing.get_type_hints(cls)
    fields = {}
    for f in dataclasses.fields(cls):
        inner = [a for a in typing.get_args(hints[f.name]) if dataclasses.is_dataclass(a)]
        sub = hints[f.name] if dataclasses.is_dataclass(hints[f.name]) else (inner[0] if inner else None)
        fields[f.name] = st.one_of(values, mapping_for(sub, depth + 1)) if sub is not None and depth < 2 else values
    known = st.fixed_dictionaries({}, optional=fields)
    return st.one_of(known, known.flatmap(lambda d: st.dictionaries(st.text(max_size=8), values, max_size=1).map(
        lambda extra: {**extra, **d})))


def finite_floats(cfg) -> None:
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            finite_floats(value)
        elif isinstance(value, float):
            assert math.isfinite(value), f"{f.name} = {value} accepted"


def assert_valid(cfg) -> None:
    """An accepted config: only finite floats anywhere, and it passes validation a second time."""
    finite_floats(cfg)
    validate(cfg)


def assert_one_line(err: ConfigError) -> None:
    message = str(err)
    assert message and "\n" not in message and "Traceback" not in message


def round_trip(cls: type, cfg) -> None:
    path = save_config(cfg, WORK / "saved.yaml")
    assert load_config(cls, path) == cfg


@FUZZ
@given(text=st.text(max_size=200))
def test_any_yaml_text_gives_a_config_or_one_config_error(text):
    path = WORK / "any.yaml"
    path.write_text(text, encoding="utf-8")
    for cls in STAGES:
        try:
            cfg = load_config(cls, path)
        except ConfigError as e:
            assert_one_line(e)
        else:
            assert_valid(cfg)


@FUZZ
@given(data=st.data())
def test_any_mapping_gives_a_config_or_one_config_error(data):
    cls = data.draw(st.sampled_from(STAGES))
    mapping = data.draw(mapping_for(cls))
    path = WORK / "mapping.yaml"
    path.write_text(yaml.safe_dump(mapping, allow_unicode=True), encoding="utf-8")
    try:
        cfg = load_config(cls, path)
    except ConfigError as e:
        assert_one_line(e)
    else:
        assert_valid(cfg)
        round_trip(cls, cfg)


@FUZZ
@given(data=st.data())
def test_any_override_gives_a_config_or_one_config_error(data):
    cls = data.draw(st.sampled_from(STAGES))
    names = [f.name for f in dataclasses.fields(cls)] + ["optim.lr", "optim.adam_eps", "generation.top_p",
                                                         "data.limit", "lora.dropout", "prompts.columns"]
    key = data.draw(st.one_of(st.sampled_from(names), st.text(max_size=10)))
    raw = data.draw(st.one_of(st.text(max_size=20), values.map(lambda v: yaml.safe_dump(v).strip())))
    try:
        cfg = load_config(cls, None, [f"{key}={raw}"])
    except ConfigError as e:
        assert_one_line(e)
    else:
        assert_valid(cfg)


@FUZZ
@given(mapping=mapping_for(PipelineConfig))
def test_any_pipeline_mapping_gives_a_config_or_one_config_error(mapping):
    path = WORK / "pipeline.yaml"
    path.write_text(yaml.safe_dump(mapping, allow_unicode=True), encoding="utf-8")
    try:
        cfg = load_pipeline(str(path))
    except ConfigError as e:
        assert_one_line(e)
    else:
        assert_valid(cfg)


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "1e999"])
@pytest.mark.parametrize("key", ["optim.lr", "optim.adam_eps", "optim.max_grad_norm", "optim.weight_decay",
                                 "epochs", "eval_fraction", "lora.dropout"])
def test_non_finite_numbers_are_refused_everywhere(key, value):
    with pytest.raises(ConfigError, match=rf"^{key}: must be a finite number"):
        load_config(SFTConfig, None, [f"{key}={value}"])


@pytest.mark.parametrize("cls, override, message", [
    (PPOConfig, "missing_eos_penalty=.nan", "missing_eos_penalty: must be a finite number, got nan"),
    (PPOConfig, "missing_eos_penalty=-1", "ppo.missing_eos_penalty: must be >= 0"),
    (PPOConfig, "reward_clip=0", "ppo.reward_clip: must be > 0"),
    (PPOConfig, "critic_lr=-1e-5", "ppo.critic_lr: must be > 0"),
    (PPOConfig, "optim.lr=.inf", "optim.lr: must be a finite number, got inf"),
    (SFTConfig, "optim.adam_eps=0", "optim.adam_eps: must be > 0"),
    (SFTConfig, "optim.max_grad_norm=-1", "optim.max_grad_norm: must be > 0"),
    (SFTConfig, "seed=-1", "seed: must be in [0, 4294967295], got -1"),
    (SFTConfig, "seed=4294967296", "seed: must be in [0, 4294967295]"),
    (SFTConfig, "lora.alpha=0", "lora.alpha: must be > 0"),
    (SFTConfig, "lora.dropout=1", "lora.dropout: must be < 1"),
    (SFTConfig, "lora.target_modules=[]", "lora.target_modules: must be \"all-linear\" or a non-empty list"),
    (SFTConfig, "data.columns={prompt: 3}", "data.columns.prompt: must be a column name (text), got 3"),
    (LabelConfig, "min_gap=.nan", "min_gap: must be a finite number"),
    (LabelConfig, "min_gap=-0.1", "label.min_gap: must be >= 0"),
    (LabelConfig, "generation.temperature=.inf", "generation.temperature: must be a finite number"),
    (RewardConfig, "normalize_generation.top_k=-1", "normalize_generation.top_k: must be >= 0"),
    (RewardConfig, "max_seq_len=1e400", "max_seq_len: must be an integer"),
    (RewardConfig, "epochs=123456789012345678901234567890e300", "epochs: must be a finite number"),
    # a union names every alternative, not only the first
    (PPOConfig, "share_prompt_prefix=maybe", "share_prompt_prefix: must be true or false, or one of 'auto', got 'maybe'"),
])
def test_each_range_check_names_the_key(cls, override, message):
    with pytest.raises(ConfigError) as info:
        load_config(cls, None, [override])
    assert message in str(info.value)


def test_a_config_built_in_python_is_checked_like_yaml():
    """`validate` re-checks types and finiteness of what code set, not only what YAML gave."""
    cfg = SFTConfig()
    cfg.optim.lr = float("nan")
    with pytest.raises(ConfigError, match="optim.lr: must be a finite number, got nan"):
        validate(cfg)
    cfg = SFTConfig(batch_size="8")
    with pytest.raises(ConfigError, match="batch_size: must be an integer, got '8'"):
        validate(cfg)
    cfg = PPOConfig(stop_on="kl_blowup")
    with pytest.raises(ConfigError, match="stop_on: must be a list, got 'kl_blowup'"):
        validate(cfg)


def test_a_field_may_opt_in_to_non_finite_values():
    from quartet.config import from_dict

    @dataclasses.dataclass
    class Bounds:
        upper: float = dataclasses.field(default=math.inf, metadata={"non_finite": True})
        lower: float = 0.0

    assert from_dict(Bounds, {"upper": float("inf")}).upper == math.inf
    with pytest.raises(ConfigError, match="lower: must be a finite number"):
        from_dict(Bounds, {"lower": float("-inf")})
