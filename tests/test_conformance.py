import pytest

import schemes
from conformance import CHECKS, EXPECTED_FAILURES


@pytest.mark.parametrize("name", schemes.available())
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_conformance(check, name):
    reason = EXPECTED_FAILURES.get((check.__name__, name))
    if reason:
        pytest.xfail(reason)
    check(name)
