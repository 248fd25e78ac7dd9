"""`flare.session.Session`, the name the README's quickstart taught before the
runtime moved to `flare.core` (0.2): kept so existing code keeps working.
New code imports `from flare.core import Session`."""
from flare.core.session import Session

__all__ = ["Session"]
