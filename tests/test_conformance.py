"""The packaged conformance suite (flare.conformance), run as part of the project's tests
over every backend selected with --backends."""
from flare.conformance.test_lifecycle import *  # noqa: F401,F403
from flare.conformance.test_ops import *  # noqa: F401,F403
