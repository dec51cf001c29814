"""`quartet annotate` without the annotate extra: one error line saying what to install, no traceback."""

import importlib.util
import json

from quartet import cli


def test_without_the_annotate_extra_the_command_says_what_to_install(tmp_path, capsys, monkeypatch):
    rows = [{"prompt": "p", "completion": "a"}, {"prompt": "p", "completion": "b"}]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    assert cli.main(["annotate", str(tmp_path / "s.jsonl"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == "error: annotate: the server needs fastapi: pip install 'quartet[annotate]'\n"
    assert not (tmp_path / "out").exists()
