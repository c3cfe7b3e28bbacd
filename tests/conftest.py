import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# whatever third-party kvharness plug-ins this machine has installed stay out of the project's own
# sweeps and tests (kvcommon.plugins); the tests of the plug-in route switch them back on
os.environ.setdefault("KVHARNESS_PLUGINS", "0")
# the costs per trial the progress line learns from earlier runs (harness.progress.CostHistory) go to
# a file of the test session's own, not the user's cache
os.environ.setdefault("KVHARNESS_COST_HISTORY", os.path.join(tempfile.mkdtemp(prefix="kvharness-costs-"), "costs.json"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for a module of many small problems: on a shared 2-core machine
    the thread pool's hand-offs cost tens of ms per call, more than the work (modules that use
    it: `pytestmark = pytest.mark.usefixtures("one_torch_thread")`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
