"""A pytest plugin for device calls that may be cut off: each failure's traceback is printed
the moment its report reaches the controller (xdist included), not in the summary at the end."""
import sys


def pytest_runtest_logreport(report):
    if report.failed:
        print(f"\n=== FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n",
              file=sys.stderr, flush=True)
    elif report.when == "call":
        print(f"=== {report.outcome} {report.nodeid} {report.duration:.1f}s", file=sys.stderr, flush=True)
