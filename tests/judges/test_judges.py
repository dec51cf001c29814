"""Reward specs resolve to checked reward functions; VADER is the positive-review gold judge."""

import sys

import numpy as np
import pytest
import torch

from quartet.errors import ConfigError, ModelError
from quartet.judges import vader_score
from quartet.judges.vader import _analyzer
from quartet.rollout.rewards import load_reward_fn
from quartet.tasks import get_task


def test_vader_scores_and_caches_its_analyzer():
    pos, neg, neutral, empty = vader_score(["What a great, wonderful film!", "Terrible and boring.",
                                            "The film is 90 minutes long.", ""])
    assert 0.8 < pos <= 1.0 and -1.0 <= neg < -0.5 and neutral == 0.0 and empty == 0.0
    assert all(type(s) is float for s in vader_score(["ok"]))
    assert _analyzer() is _analyzer()


def test_task_spec_is_the_gold_judge():
    fn = load_reward_fn("task:positive-review")
    responses = ["I loved it.", "I hated it."]
    assert fn(["p", "p"], responses) == get_task("positive-review").judge(["p", "p"], responses)
    assert load_reward_fn("task:tiny-target")(["p"], ["aab"]) == [pytest.approx(2 / 3)]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "import numpy as np\n"
        "def length(prompts, responses):\n    return [len(r) for r in responses]\n"
        "def as_array(prompts, responses):\n    return np.array([1.5] * len(responses))\n"
        "def as_tensor(prompts, responses):\n"
        "    import torch\n    return torch.tensor([2.0] * len(responses))\n"
        "def words(prompts, responses):\n    return ['many'] * len(responses)\n"
        "def boom(prompts, responses):\n    raise KeyError('label')\n"
        "def one_arg(responses):\n    return []\n"
        "class Scorer:\n    @staticmethod\n    def score(prompts, responses):\n        return [0.0] * len(responses)\n"
    )
    monkeypatch.chdir(tmp_path)  # found from the current directory, as the installed CLI would
    yield
    sys.modules.pop("my_rewards", None)
    if str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))


def test_module_function_from_current_directory(user_module):
    fn = load_reward_fn("my_rewards:length")
    assert fn(["a", "b"], ["xyz", ""]) == [3.0, 0.0]
    assert load_reward_fn("my_rewards:as_array")(["a"], ["b"]) == [1.5]
    assert load_reward_fn("my_rewards:as_tensor")(["a"], ["b"]) == [2.0]
    assert load_reward_fn("my_rewards:Scorer.score")(["a"], ["b"]) == [0.0]


@pytest.mark.parametrize("spec,message", [
    ("my_rewards:words", "reward 'my_rewards:words': score 0 is 'many', not a number"),
    ("my_rewards:boom", "reward 'my_rewards:boom' raised KeyError: 'label'"),
])
def test_bad_user_rewards_fail_when_called(user_module, spec, message):
    fn = load_reward_fn(spec)
    with pytest.raises(ConfigError) as info:
        fn(["p"], ["r"])
    assert str(info.value) == message


def test_wrong_signature_fails_at_load(user_module):
    with pytest.raises(ConfigError, match=r"'one_arg' must accept \(prompts, responses\)"):
        load_reward_fn("my_rewards:one_arg")


def test_import_error_inside_user_module_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text("import not_a_real_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        load_reward_fn("broken_rewards:score")
    assert str(info.value) == ("reward 'broken_rewards:score': importing 'broken_rewards' failed: "
                               "No module named 'not_a_real_dependency'")
    sys.modules.pop("broken_rewards", None)


@pytest.mark.parametrize("spec", ["runs/rm/model", "/abs/path", "just-a-name", "C:\\models\\rm"])
def test_non_function_specs_point_to_the_reward_model_loader(spec):
    with pytest.raises(ModelError, match="quartet.models.load_reward_model"):
        load_reward_fn(spec)


def test_existing_directory_with_colon_like_name_is_not_imported(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rm:v1").mkdir()
    with pytest.raises(ModelError):
        load_reward_fn("rm:v1")


def test_checked_wrapper_accepts_numpy_and_torch_scalars():
    from quartet.rollout.rewards import _checked

    fn = _checked(lambda p, r: [np.float32(0.5), torch.tensor(1.0)], "x:y")
    assert fn(["a", "b"], ["c", "d"]) == [0.5, 1.0]
