"""Rows become typed examples in every supported shape; column remaps and limits apply."""

import json

import pytest

from quartet.config import DataConfig
from quartet.data import (
    PreferenceExample,
    PromptExample,
    SFTExample,
    load_preferences,
    load_prompts,
    load_sft,
)
from quartet.errors import DataError


def jsonl(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def user(text):
    return {"role": "user", "content": text}


def bot(text):
    return {"role": "assistant", "content": text}


def test_prompts_text_messages_and_trailing_assistant_dropped(tmp_path):
    path = jsonl(tmp_path, [
        {"prompt": "plain"},
        {"prompt": [{"role": "system", "content": "be brief"}, user("hi")]},
        {"messages": [user("q"), bot("a")]},
    ])
    got = load_prompts(DataConfig(path=path))
    assert got == [
        PromptExample("plain"),
        PromptExample([{"role": "system", "content": "be brief"}, user("hi")]),
        PromptExample([user("q")]),
    ]


def test_prompts_column_remap_and_limit(tmp_path):
    path = jsonl(tmp_path, [{"question": f"q{i}", "other": 1} for i in range(5)])
    got = load_prompts(DataConfig(path=path, columns={"prompt": "question"}, limit=2))
    assert [e.prompt for e in got] == ["q0", "q1"]


def test_packaged_task_prompts_load():
    got = load_prompts(DataConfig(path="task:positive-review/train"))
    assert len(got) == 480 and all(isinstance(e.prompt, str) for e in got)


def test_sft_prompt_completion_and_messages(tmp_path):
    path = jsonl(tmp_path, [
        {"prompt": "p", "completion": "c"},
        {"messages": [user("u1"), bot("a1"), user("u2"), bot("a2")]},
    ])
    got = load_sft(DataConfig(path=path))
    assert got[0] == SFTExample("p", "c")
    assert got[1] == SFTExample([user("u1"), bot("a1"), user("u2")], "a2")


def test_packaged_sft_split_loads_with_extra_columns():
    got = load_sft(DataConfig(path="task:positive-review/sft"))
    assert 100 <= len(got) <= 200


def test_preferences_text_with_margin(tmp_path):
    path = jsonl(tmp_path, [{"prompt": "p", "chosen": "good", "rejected": "bad", "margin": 2}])
    assert load_preferences(DataConfig(path=path)) == [PreferenceExample("p", "good", "bad", 2.0)]


def test_preferences_ultrafeedback_shape(tmp_path):
    path = jsonl(tmp_path, [{
        "prompt": "p",
        "chosen": [user("p"), bot("good")],
        "rejected": [user("p"), bot("bad")],
    }])
    assert load_preferences(DataConfig(path=path)) == [PreferenceExample("p", "good", "bad")]


def test_preferences_hh_text_and_hh_messages_share_prefix(tmp_path):
    path = jsonl(tmp_path, [
        {"chosen": "\n\nHuman: hi\n\nAssistant: hello!\n\nHuman: joke?\n\nAssistant: a good one",
         "rejected": "\n\nHuman: hi\n\nAssistant: hello!\n\nHuman: joke?\n\nAssistant: no"},
        {"chosen": [user("q"), bot("yes")], "rejected": [user("q"), bot("no")]},
    ])
    got = load_preferences(DataConfig(path=path))
    assert got[0] == PreferenceExample([user("hi"), bot("hello!"), user("joke?")], "a good one", "no")
    assert got[1] == PreferenceExample([user("q")], "yes", "no")


def test_preferences_csv_margin_cells_are_parsed(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("prompt,chosen,rejected,margin\np,good,bad,0.5\np,good,bad,\n")
    got = load_preferences(DataConfig(path=str(path)))
    assert [e.margin for e in got] == [0.5, None]


def test_preferences_remapped_columns(tmp_path):
    path = jsonl(tmp_path, [{"q": "p", "win": "good", "lose": "bad"}])
    cfg = DataConfig(path=path, columns={"prompt": "q", "chosen": "win", "rejected": "lose"})
    assert load_preferences(cfg) == [PreferenceExample("p", "good", "bad")]


# ---- prompts from SFT and preference files (PPO / GRPO / label read the prompt part; issue 35)
HH_CHOSEN = "\n\nHuman: hi\n\nAssistant: hello!\n\nHuman: joke?\n\nAssistant: a good one"
HH_REJECTED = "\n\nHuman: hi\n\nAssistant: hello!\n\nHuman: joke?\n\nAssistant: no"


def test_prompts_from_an_sft_file_keep_each_prompt_once(tmp_path):
    path = jsonl(tmp_path, [
        {"prompt": "p1", "completion": "c1"},
        {"prompt": "p1", "completion": "another answer"},
        {"prompt": "p2", "completion": "c2"},
        {"messages": [user("u1"), bot("a1"), user("u2"), bot("a2")]},
        {"messages": [user("u1"), bot("a1"), user("u2"), bot("a different a2")]},
    ])
    got = load_prompts(DataConfig(path=path))
    assert got == [PromptExample("p1"), PromptExample("p2"), PromptExample([user("u1"), bot("a1"), user("u2")])]
    # the same prompts the SFT loader pairs with the completions
    sft_prompts = [e.prompt for e in load_sft(DataConfig(path=path))]
    assert [e.prompt for e in got] == list({repr(p): p for p in sft_prompts}.values())


def test_prompts_from_a_preference_file_with_a_prompt_field(tmp_path):
    path = jsonl(tmp_path, [
        {"prompt": "p", "chosen": "good", "rejected": "bad"},
        {"prompt": "p", "chosen": "fine", "rejected": "worse"},
        {"prompt": "q", "chosen": [user("q"), bot("yes")], "rejected": [user("q"), bot("no")]},  # UltraFeedback
        {"prompt": [user("r")], "chosen": "x", "rejected": "y"},
    ])
    assert load_prompts(DataConfig(path=path)) == [PromptExample("p"), PromptExample("q"), PromptExample([user("r")])]


def test_prompts_from_hh_rows_are_the_prompts_rm_and_dpo_read(tmp_path):
    path = jsonl(tmp_path, [
        {"chosen": HH_CHOSEN, "rejected": HH_REJECTED},
        {"chosen": HH_CHOSEN.replace("a good one", "another"), "rejected": HH_REJECTED},  # a second pair, same prompt
        {"chosen": [user("q"), bot("yes")], "rejected": [user("q"), bot("no")]},
    ])
    got = [e.prompt for e in load_prompts(DataConfig(path=path))]
    assert got == [[user("hi"), bot("hello!"), user("joke?")], [user("q")]]
    pairs = load_preferences(DataConfig(path=path))
    assert got == [pairs[0].prompt, pairs[2].prompt] and pairs[0].prompt == pairs[1].prompt


def test_prompts_from_hh_rows_with_a_remapped_chosen_column(tmp_path):
    path = jsonl(tmp_path, [{"win": HH_CHOSEN, "lose": HH_REJECTED}])
    got = load_prompts(DataConfig(path=path, columns={"chosen": "win"}))
    assert got == [PromptExample([user("hi"), bot("hello!"), user("joke?")])]


def test_prompts_from_a_preference_csv_in_hh_text(tmp_path):
    import csv

    path = tmp_path / "hh.csv"
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([["chosen", "rejected"], [HH_CHOSEN, HH_REJECTED], [HH_CHOSEN, HH_REJECTED]])
    assert load_prompts(DataConfig(path=str(path))) == [PromptExample([user("hi"), bot("hello!"), user("joke?")])]


@pytest.mark.parametrize("row, message", [
    ({"chosen": "just an answer", "rejected": "another"}, "d.jsonl row 1: field 'chosen' is text but there is no `prompt`"),
    ({"chosen": [user("q")], "rejected": [user("q"), bot("no")]}, "d.jsonl row 1: field 'chosen' has no assistant turn"),
    ({"chosen": [bot("hi")], "rejected": [bot("no")]}, "d.jsonl row 1: field 'chosen' has no user turn"),
    ({"completion": "c"}, "d.jsonl row 1: missing field 'prompt' (fields in the row: completion"),
])
def test_prompts_from_a_broken_preference_row_name_row_and_field(tmp_path, row, message):
    with pytest.raises(DataError) as e:
        load_prompts(DataConfig(path=jsonl(tmp_path, [row])))
    assert message in str(e.value) and "\n" not in str(e.value)
