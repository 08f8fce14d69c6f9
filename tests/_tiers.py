"""Pytest plugin: the test tiers, and the test-time budget guard that ``.ci/run`` turns on.

Tiers. A test marked with a tier (``TIERS``; pyproject describes each) is also marked ``slow`` here, unless
it is marked ``smoke`` too, so the default ``-m "not slow"`` leaves the tier out but keeps its smoke cases,
and ``-m kernels`` (say) runs that whole tier. ``.ci/run`` runs a tier when its code changes
(``scripts/changed_tiers.sh``); ``scripts/test_all.sh`` runs every test.

Budget guard. ``--budget-s=S`` fails the session (exit status 1) when the whole run takes longer than ``S`` seconds;
``--test-limit-s=L`` fails it when a test that belongs to no tier (none of ``TIERS`` and not ``slow``) takes
longer than ``L`` seconds, setup, call and teardown together. Both are off unless given, so a developer's
run on a slow machine never fails on time. The verdict is printed at the end of the terminal summary, the
offending tests slowest first.

A module- or class-scoped fixture's setup is charged to the first test that uses it: that is where the
time goes, and what a tier marker on that test's module removes.
"""

from __future__ import annotations

import time

import pytest

TIERS = ("distributed", "sandbox_attacks", "kernels", "verl")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test of a tier ``slow`` unless it is one of the tier's ``smoke`` cases (before ``-m``); a test of
    a tier that was marked ``slow`` itself is also marked ``long``: ``.ci/run``'s tier runs leave it out, as CI
    always left out the slow tests (``scripts/test_all.sh`` runs it)."""
    for item in items:
        if any(item.get_closest_marker(t) for t in TIERS) and item.get_closest_marker("smoke") is None:
            if item.get_closest_marker("slow") is not None:
                item.add_marker(pytest.mark.long)
            item.add_marker(pytest.mark.slow)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("budget", "test-time budget guard (off unless given)")
    group.addoption("--budget-s", type=float, default=None, help="fail when the whole run takes longer (s)")
    group.addoption(
        "--test-limit-s", type=float, default=None, help="fail when a test outside every tier takes longer (s)"
    )


class BudgetGuard:
    """Adds up each test's phases and checks the two limits when the session ends."""

    def __init__(self, budget_s: float | None, limit_s: float | None) -> None:
        self.budget_s, self.limit_s = budget_s, limit_s
        self.start = time.monotonic()
        self.seconds: dict[str, float] = {}
        self.untiered: set[str] = set()
        self.over: list[tuple[float, str]] = []
        self.elapsed = 0.0

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.untiered = {
            item.nodeid for item in items if not any(item.get_closest_marker(m) for m in (*TIERS, "slow"))
        }

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self.elapsed = time.monotonic() - self.start
        if self.limit_s is not None:
            self.over = sorted(
                ((s, n) for n, s in self.seconds.items() if n in self.untiered and s > self.limit_s), reverse=True
            )
        if (self.over or self.budget_exceeded) and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @property
    def budget_exceeded(self) -> bool:
        return self.budget_s is not None and self.elapsed > self.budget_s

    def pytest_terminal_summary(self, terminalreporter) -> None:  # noqa: ANN001 - pytest's TerminalReporter
        tr = terminalreporter
        if self.budget_s is not None:
            verdict = "OVER BUDGET" if self.budget_exceeded else "within budget"
            tr.write_line(f"budget guard: the run took {self.elapsed:.0f} s of {self.budget_s:.0f} s: {verdict}")
        if self.over:
            tr.write_line(
                f"budget guard: {len(self.over)} test(s) outside every tier took over {self.limit_s:g} s; "
                f"speed them up or mark them with one of {', '.join(TIERS)} or slow:"
            )
            for seconds, nodeid in self.over:
                tr.write_line(f"  {seconds:7.2f} s  {nodeid}")


def pytest_configure(config: pytest.Config) -> None:
    budget_s, limit_s = config.getoption("budget_s"), config.getoption("test_limit_s")
    if budget_s is not None or limit_s is not None:
        config.pluginmanager.register(BudgetGuard(budget_s, limit_s), "agentrl-budget-guard")
