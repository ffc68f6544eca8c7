"""The doctor's findings: one ``Finding`` per line of its report, gathered by check name in a ``Report``."""

from __future__ import annotations

from dataclasses import dataclass

OK, WARN, ERROR = "ok", "warn", "error"


@dataclass
class Finding:
    """One line of the doctor's report: which check, how bad (``ok``, ``warn``, ``error``), and what it found."""

    check: str
    severity: str
    message: str


class Report:
    """The findings so far, added by check name."""

    def __init__(self) -> None:
        self.findings: list[Finding] = []

    def add(self, check: str, severity: str, message: str) -> None:
        self.findings.append(Finding(check, severity, message))
