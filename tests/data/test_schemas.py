"""Rows become typed examples in every supported shape; column remaps and limits apply."""

import json

from quartet.config import DataConfig
from quartet.data import (
    PreferenceExample,
    PromptExample,
    SFTExample,
    load_preferences,
    load_prompts,
    load_sft,
)


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
