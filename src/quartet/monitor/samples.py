"""samples.jsonl: every sampled response of a run, one JSON object a line (docs/CONTRACTS.md).

Appended as the run goes, so a crashed run keeps what it sampled; on resume, lines logged after the
checkpoint it resumes from are dropped (from samples.jsonl and metrics.jsonl alike), so the files read
as if the run had never stopped.
"""

from __future__ import annotations

import json
from pathlib import Path

from quartet.atomic import atomic_write_text


def append_samples(run_dir: Path, records: list[dict]) -> None:
    if not records:
        return
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "samples.jsonl", "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def truncate_after(path: Path, stage: str, last_step: int) -> None:
    """Drop the records of `stage` whose step is after `last_step` (and unreadable partial lines)."""
    path = Path(path)
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(rec, dict) or rec.get("stage", stage) != stage or rec.get("step", 0) <= last_step:
            kept.append(line)
    atomic_write_text(path, "".join(k + "\n" for k in kept))
