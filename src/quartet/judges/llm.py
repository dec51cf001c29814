"""The judge spec `llm:<model>`: a language model comparing answers under a rubric, here or on a server.

`load_llm_judge` turns the spec and its settings (quartet.config.LLMJudgeConfig) into a pairwise judge
(quartet.judges.pairwise.PairwiseJudge) behind the verdict cache:

- backend `local` (quartet.judges.llm_local): <model> is anything quartet.models.load_causal_lm takes (a dir, a
  .gguf, smollm2-135m-instruct, tiny:...), read from its next-token log-probs;
- backend `openai` (quartet.judges.llm_http): <model> is the name an OpenAI-compatible server at `base_url` serves,
  its key read from the environment variable `api_key_env`; the server is asked once for its models before
  anything else, so a wrong URL, key or model name is one error line;
- `auto`: openai when base_url is set, else local.

The rubric: the setting's text, or the file it names (a single line ending in .txt or .md: one principle per line),
else the task's own (quartet.tasks.Task.rubric), else DEFAULT_RUBRIC. Blank lines and the lines' outer spaces are
dropped. The judge's name (part of every cache key) holds the model, the backend, the mode, the prompt's version
and, for a local model, the path it resolved to and the dtype it ran in, so a verdict is read back only by the
judge that gave it. How a pair's two orders make one verdict (cfg.orders) is the caller's
(quartet.judges.pairwise.judge_both_orders): the cache holds each order's raw log-odds, good for either rule.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from quartet.config import LLMJudgeConfig
from quartet.errors import ConfigError
from quartet.judges.llm_http import OpenAIJudge
from quartet.judges.llm_local import LocalLLMJudge
from quartet.judges.pairwise import PairwiseJudge
from quartet.judges.verdict_cache import CachedJudge, VerdictCache

PREFIX = "llm:"
DEFAULT_RUBRIC = "\n".join([
    "- Helpful: the answer does what the prompt asks.",
    "- Honest: it states nothing false and does not pretend to know what it does not.",
    "- Harmless: nothing dangerous, hateful or demeaning.",
    "- On-topic: it stays with the prompt's subject.",
    "- Concise: no padding, no repetition.",
])
"""the principles of a judge given none, where the task has none either"""
RUBRIC_FILE_SUFFIXES = (".txt", ".md")
RUBRIC_MAX_BYTES = 1 << 20
"""a rubric file larger than this is refused before it is read (a wrong path, not principles)"""
CACHE_NAME = "verdicts.sqlite"


def is_llm_spec(spec) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def _at(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def llm_model(spec: str, where: str) -> str:
    """The <model> of `llm:<model>`; `where` names the setting (`label.judge`)."""
    model = spec[len(PREFIX):].strip() if is_llm_spec(spec) else ""
    if not model:
        raise ConfigError(f"{where}: must be llm:<model> (a model dir, a .gguf, smollm2-135m-instruct, or the "
                          f"server's model name), got {spec!r}")
    return model


def is_rubric_file(value: str) -> bool:
    return "\n" not in value and value.strip().lower().endswith(RUBRIC_FILE_SUFFIXES)


def read_rubric(value: str | None, default: str | None, where: str) -> str:
    """The rubric text (module docstring); `where` is the judge's settings (`label.llm_judge`): errors name
    `<where>.rubric`."""
    field = _at(where, "rubric")
    if value is None:
        value = default or DEFAULT_RUBRIC
    elif is_rubric_file(value):
        path = Path(value.strip()).expanduser()
        try:
            st = path.stat()
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"{field}: {path} is not a regular file")
            if st.st_size > RUBRIC_MAX_BYTES:
                raise ConfigError(f"{field}: {path} is {st.st_size} bytes, more than a rubric's "
                                  f"{RUBRIC_MAX_BYTES} (one principle per line)")
            value = path.read_text(encoding="utf-8-sig")
        except FileNotFoundError:
            raise ConfigError(f"{field}: {path}: no such file (a rubric file holds one principle per line)") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{field}: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise ConfigError(f"{field}: {path}: cannot be read ({e.strerror or e})") from None
        if not value.strip():
            raise ConfigError(f"{field}: {path} is empty (a rubric file holds one principle per line)")
    lines = [line.strip() for line in value.splitlines() if line.strip()]
    if not lines:
        raise ConfigError(f"{field}: is empty (write the principles, or null for the task's own)")
    return "\n".join(lines)


def cache_file(setting: str | None, beside: Path) -> Path | None:
    """Where the verdict cache of a stage writing into folder `beside` lives: "auto" = `beside`/verdicts.sqlite, a
    path as given, None = no cache."""
    if setting is None:
        return None
    return Path(beside) / CACHE_NAME if setting == "auto" else Path(setting).expanduser()


def load_llm_judge(spec: str, cfg: LLMJudgeConfig, default_rubric: str | None, cache_path: Path | None,
                   where: str) -> CachedJudge:
    """The judge `spec` (`llm:<model>`) with settings `cfg`, its verdicts cached in `cache_path` (None: not cached).

    `default_rubric`: the task's, used when cfg.rubric is null. `where`: the section holding the spec and its
    settings (`label`, `eval`; "" for none), so errors name `label.judge`, `label.llm_judge.rubric`, ...
    The result counts the verdicts it paid for (`calls`) and those it read back (`hits`)."""
    settings = _at(where, "llm_judge")
    cfg.validate(settings)
    model = llm_model(spec, _at(where, "judge"))
    rubric = read_rubric(cfg.rubric, default_rubric, settings)
    # the cache first: a file at its path that is not one is refused before a model loads or a server is asked
    cache = VerdictCache(cache_path, _at(settings, "cache")) if cache_path is not None else None
    judge: PairwiseJudge
    if cfg.resolved_backend == "openai":
        judge = openai_judge(model, cfg, rubric, settings)
        judge.check()
        chunk = cfg.max_in_flight * 8
    else:
        judge = LocalLLMJudge(model, rubric, cfg.mode, cfg.batch_size, where=_at(where, "judge"), dtype=cfg.dtype)
        chunk = cfg.batch_size * 4
    return CachedJudge(judge, cache, rubric, chunk_size=chunk)


def openai_judge(model: str, cfg: LLMJudgeConfig, rubric: str, settings: str) -> OpenAIJudge:
    """The OpenAI-compatible judge `cfg` describes, its key read from cfg.api_key_env; `settings`: the section errors
    name (`label.llm_judge`). One construction for loading and for the no-load check, so the check is the one the
    stage makes."""
    return OpenAIJudge(cfg.base_url, model, os.environ.get(cfg.api_key_env) or None, rubric, cfg.mode, cfg.timeout,
                       cfg.max_retries, cfg.max_in_flight, where=settings, api_key_env=cfg.api_key_env)


__all__ = ["CACHE_NAME", "DEFAULT_RUBRIC", "PREFIX", "cache_file", "is_llm_spec", "is_rubric_file", "llm_model",
           "load_llm_judge", "openai_judge", "read_rubric"]

