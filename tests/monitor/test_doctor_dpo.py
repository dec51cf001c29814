"""The doctor and the report on DPO runs: `both_logps_down` fires on its failure, stays quiet on healthy
runs (and on the mild chosen drift real DPO runs show), and the report draws the DPO curves."""

from __future__ import annotations

import pytest
from dpo_streams import BETA, both_down_dpo_run, dpo_run, healthy_dpo_run
from ppo_streams import healthy_run, write_run

from quartet.monitor.doctor import LiveDoctor, diagnose
from quartet.monitor.report import write_report
from quartet.monitor.rules import RULES


@pytest.mark.parametrize("seed", range(6))
def test_healthy_dpo_run_has_no_findings(seed):
    assert diagnose(healthy_dpo_run(seed=seed)) == []


@pytest.mark.parametrize("seed", range(6))
def test_both_logps_down_fires_on_its_failure(seed):
    findings = diagnose(both_down_dpo_run(seed=seed))
    assert [f.rule for f in findings] == ["both_logps_down"]
    f = findings[0]
    assert f.severity == RULES["both_logps_down"].severity == "warning" and f.stage == "dpo"
    assert f.evidence["metric"] == "rewards/chosen" and f.evidence["window"][1] == f.step
    assert {"rewards/rejected", "logps/chosen", "logps/rejected"} <= set(f.evidence["related"])
    assert "less likely" in f.symptom and "beta" in f.fix
    assert f.step < 400  # found while the run goes on, not only at its end


def test_mild_chosen_drift_is_not_a_finding():
    # chosen -1.5 nats while rejected loses 20: the margin comes from the rejected answers
    assert diagnose(dpo_run(chosen_end=-1.5, rejected_end=-20.0)) == []
    # both fall, but the chosen answers by less than a nat
    assert diagnose(dpo_run(chosen_end=-0.6, rejected_end=-1.5)) == []


def test_threshold_is_in_nats_not_reward_units():
    """The same reward stream read with beta 1 instead of 0.1 is a 10x smaller change of log-prob."""
    records = both_down_dpo_run()
    assert [f.rule for f in diagnose(records)] == ["both_logps_down"]
    for r in records:
        r["dpo/beta"] = 1.0
    assert diagnose(records) == []
    assert BETA == 0.1


def test_both_logps_down_waits_for_six_points_and_ppo_runs_never_trigger_it():
    assert diagnose(both_down_dpo_run()[:5]) == []
    assert not [f for f in diagnose(healthy_run(60)) if f.rule == "both_logps_down"]


def test_live_doctor_can_stop_a_dpo_run_on_it():
    doctor = LiveDoctor(stop_on=["both_logps_down"])
    for r in both_down_dpo_run():
        doctor.update(r["step"], r)
        if doctor.should_stop:
            break
    assert doctor.stop_reason.startswith("doctor rule 'both_logps_down' fired")


def test_report_on_a_dpo_run(tmp_path):
    run = write_run(tmp_path / "dpo", both_down_dpo_run())
    page = write_report(run).read_text()
    assert "WARNING: both_logps_down" in page
    for title in ("DPO loss and implicit-reward accuracy", "DPO implicit rewards", "Log-probs of the chosen"):
        assert title in page
    assert "rewards/margins" in page and "dpo/loss" in page  # in the final-values table
    assert {p.name for p in (tmp_path / "dpo" / "plots").iterdir()} >= {"dpo-dpo_loss.png", "dpo-dpo_logps.png"}
