"""The packaged conformance suite (flare.plugins.testing.conformance), run as part of the project's tests
over every backend selected with --backends."""
from flare.plugins.testing.conformance.test_lifecycle import *  # noqa: F401,F403
from flare.plugins.testing.conformance.test_ops import *  # noqa: F401,F403
