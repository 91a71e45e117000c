"""Hypothesis profiles for the property suite.

`default`: quick local runs. `ci`: 500 examples per property, no deadline and derandomized,
so a CI run tests the same examples every time. HYPOTHESIS_PROFILE picks one; without it,
`ci` when the CI environment variable is set, else `default`.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci",
    max_examples=500,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))
