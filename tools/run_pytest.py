"""Run pytest and refuse a run that executed no test.

pytest exits 5 when it collected nothing; a CI that let that pass would report green with
no test run, so it is turned into a failure with a clear message.
"""

from __future__ import annotations

import sys

import pytest

NO_TESTS_COLLECTED = 5

if __name__ == "__main__":
    code = pytest.main(sys.argv[1:])
    if code == NO_TESTS_COLLECTED:
        print(f"run_pytest: no tests were collected for {sys.argv[1:]}; failing", file=sys.stderr)
        code = 1
    sys.exit(int(code))
