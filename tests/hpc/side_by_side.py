"""Run a test file's slow scenarios at the same time, each test then checking its own outcome.

The scheduler and pre-emption scenarios mostly wait (a job's paced steps, a scheduler's poll
interval, a requeue hold, a launcher's kill timeout), so one scenario's waits pass while another
computes. Each scenario is a test's body; it runs in a thread of a module fixture and its
exception (an assertion, a skip) is raised again by its own test, with its traceback.
Only the scenarios of selected tests run (-k, one test id).
"""

from concurrent.futures import ThreadPoolExecutor

__all__ = ["SideBySide", "selected"]


def selected(request) -> set:
    """Names (with their [params]) of the selected tests of the requesting module."""
    return {it.name for it in request.session.items
            if getattr(it, "module", None) is request.module}


class SideBySide:
    """Outcomes of scenarios run together: ``check(name)`` raises what scenario ``name`` raised."""

    def __init__(self, request, scenarios):
        """``scenarios``: {test name (with its [params]): zero-argument body}."""
        wanted = selected(request)
        chosen = {name: body for name, body in scenarios.items() if name in wanted}
        self.errors = {}
        if not chosen:
            return
        with ThreadPoolExecutor(len(chosen)) as pool:
            futures = {name: pool.submit(body) for name, body in chosen.items()}
        self.errors = {name: f.exception() for name, f in futures.items()}

    def check(self, name):
        """Raise scenario ``name``'s exception again (its test fails or skips as it would alone)."""
        if name not in self.errors:
            raise KeyError(f"scenario {name!r} did not run; ran {sorted(self.errors)}")
        if self.errors[name] is not None:
            raise self.errors[name]
