"""The doctor: rules over windows of logged metrics that name a symptom, its likely cause and a fix.

Each rule looks only at metrics logged up to the current step, so the same rules run live inside the
PPO loop (:class:`LiveDoctor`, which can stop a run cleanly via ``ppo.stop_on``) and afterwards over a
whole run (:func:`diagnose`, ``quartet doctor RUN_DIR``) and give the same findings at the same steps.
A rule reports once per run, at the first step where its condition holds. Apart from ``nan``, no rule
fires on fewer than 3 points of its metrics, so short runs do not raise noise; and a run too short for a rule
to fire at all is told so (:func:`unjudged`), so "no findings" on 7 iterations is not read as a clean bill of
health from rules that need 10 or 15.

The rules, their thresholds and the table of them are in quartet.monitor.rules.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from quartet.atomic import atomic_write_text
from quartet.config import load_yaml
from quartet.errors import DataError
from quartet.monitor.metrics import read_metrics, stage_dirs
from quartet.monitor.rules import RULES, Finding, History, check_rule_names, unjudged_counts


# --------------------------------------------------------------------------- running the rules
class LiveDoctor:
    """The rules, fed one step at a time during training.

    ``update(step, metrics)`` returns the findings that start at this step. When one of the rules in
    ``stop_on`` fires, ``should_stop`` becomes true and ``stop_reason`` says why; the trainer then saves
    and ends the run cleanly.
    """

    def __init__(self, rules: Iterable[str] | str | None = None, stop_on: Iterable[str] = (),
                 kl_target: float | None = None):
        names = list(RULES) if rules is None or rules == "all" else check_rule_names(rules, "rules")
        self.stop_on = check_rule_names(list(stop_on), "stop_on")
        self.rules = names + [n for n in self.stop_on if n not in names]
        self.history = History(kl_target)
        self.findings: list[Finding] = []
        self.stop_reason: str | None = None
        self._fired: set[str] = set()

    def update(self, step: int, metrics: dict) -> list[Finding]:
        self.history.add(step, metrics)
        new = []
        for name in self.rules:
            if name in self._fired:
                continue
            finding = RULES[name].check(self.history)
            if finding is not None:
                self._fired.add(name)
                new.append(finding)
        self.findings.extend(new)
        if self.stop_reason is None:
            for f in new:
                if f.rule in self.stop_on:
                    self.stop_reason = f"doctor rule '{f.rule}' fired at step {f.step}: {f.symptom}"
                    break
        return new

    @property
    def should_stop(self) -> bool:
        return self.stop_reason is not None


def diagnose(records: list[dict], kl_target: float | None = None) -> list[Finding]:
    """All findings of a whole run, each rule once per stage, in the order they start."""
    stages: dict[str, list[dict]] = {}
    for rec in records:
        stages.setdefault(str(rec.get("stage") or ""), []).append(rec)
    findings = []
    for stage, recs in stages.items():
        doctor = LiveDoctor(kl_target=kl_target)
        for rec in recs:
            for f in doctor.update(rec.get("step"), rec):
                f.stage = stage
                findings.append(f)
    return findings


def unjudged(records: list[dict]) -> list[str]:
    """The rules (or parts of rules) a run logged too few points to judge, one line each (prefixed with the
    stage when the records hold several), e.g. ``ppo: value_loss_stuck (value/loss: 7 of the 15 points it needs)``."""
    stages: dict[str, History] = {}
    for rec in records:
        stages.setdefault(str(rec.get("stage") or ""), History()).add(rec.get("step"), rec)
    prefix = len(stages) > 1
    return [f"{stage}: {line}" if prefix and stage else line
            for stage, history in stages.items() for line in unjudged_counts(history.counts())]


def unjudged_stages(stages: list[tuple[str, list[dict]]]) -> list[str]:
    """:func:`unjudged` over (stage directory name, its records) pairs, each line prefixed with the name when there
    are several."""
    many = len(stages) > 1
    return [f"{name}: {line}" if many else line for name, records in stages for line in unjudged(records)]


def unjudged_run(run_dir) -> list[str]:
    """:func:`unjudged` over a run directory (or each stage of a pipeline directory)."""
    return unjudged_stages([(name, read_metrics(d)) for name, d in stage_dirs(Path(run_dir))])


def kl_target_from_config(run_dir: Path) -> float | None:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    try:
        cfg = load_yaml(path.read_text(encoding="utf-8")) or {}
    except Exception:  # a config we cannot read only costs the target-based KL check
        return None
    if isinstance(cfg, dict) and cfg.get("adaptive_kl") and isinstance(cfg.get("kl_target"), (int, float)):
        return float(cfg["kl_target"])
    return None


def _write_findings(path: Path, findings: list[Finding]) -> None:
    atomic_write_text(path, "".join(json.dumps(f.to_dict()) + "\n" for f in findings))


def diagnose_run(run_dir) -> list[Finding]:
    """Diagnose a run directory (or each stage of a pipeline directory) and write findings.jsonl.

    Each directory with a metrics.jsonl gets its own findings.jsonl; a pipeline directory also gets the
    combined list.
    """
    run_dir = Path(run_dir)
    dirs = stage_dirs(run_dir)
    if not dirs:
        raise DataError(f"{run_dir}: no metrics.jsonl here or in its stage subdirectories")
    findings = []
    for _, d in dirs:
        found = diagnose(read_metrics(d), kl_target=kl_target_from_config(d))
        _write_findings(d / "findings.jsonl", found)
        findings.extend(found)
    if all(d != run_dir for _, d in dirs):
        _write_findings(run_dir / "findings.jsonl", findings)
    return findings


def read_findings(run_dir) -> list[Finding]:
    path = Path(run_dir) / "findings.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            out.append(Finding.from_dict(json.loads(line)))
    return out


def format_findings(findings: list[Finding], where: str = "", short: list[str] = ()) -> str:
    """The findings as text; ``short`` (from :func:`unjudged`) adds what the run was too short to judge."""
    prefix = f"{where}: " if where else ""
    if not findings:
        head = f"{prefix}no findings"
    else:
        errors = sum(f.severity == "error" for f in findings)
        head = f"{prefix}{len(findings)} finding(s): {errors} error(s), {len(findings) - errors} warning(s)"
    if short:
        head += "\ntoo short to judge: " + "; ".join(short)
    return "\n\n".join([head] + [f.format() for f in findings])


def cli(args) -> int:
    """`quartet doctor RUN_DIR`: print the findings (exit status 0 either way)."""
    findings = diagnose_run(args.run_dir)
    print(format_findings(findings, str(args.run_dir), unjudged_run(args.run_dir)))
    return 0
