import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# whatever third-party kvharness plug-ins this machine has installed stay out of the project's own
# sweeps and tests (kvcommon.plugins); the tests of the plug-in route switch them back on
os.environ.setdefault("KVHARNESS_PLUGINS", "0")
