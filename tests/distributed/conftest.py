"""The one-process side of the N-process equivalence tests, made once per session for test_processes.py (2
processes on one machine) and test_two_hosts.py (2 hosts)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def one_process(tmp_path_factory) -> dict[str, dict]:
    """mp_driver's equivalence cases (test_processes.CASES) on one process with the whole batch, one launch."""
    from test_processes import run_cases

    return run_cases(1, tmp_path_factory.mktemp("one-process"))
