"""A reward function the export tests pass as `--judge judge_helpers:length` (on sys.path via pytest)."""


def length(prompts: list[str], responses: list[str]) -> list[float]:
    return [float(len(r)) for r in responses]
