"""Watching runs: metric sinks and progress (metrics), health checks (doctor), HTML report (report)."""

from quartet.monitor.doctor import LiveDoctor, diagnose, diagnose_run
from quartet.monitor.metrics import MetricsLogger, Progress, peak_rss_mb, read_metrics, stage_dirs
from quartet.monitor.report import write_report
from quartet.monitor.rules import RULES, Finding

__all__ = [
    "RULES",
    "Finding",
    "LiveDoctor",
    "MetricsLogger",
    "Progress",
    "diagnose",
    "diagnose_run",
    "peak_rss_mb",
    "read_metrics",
    "stage_dirs",
    "write_report",
]
