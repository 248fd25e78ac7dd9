"""Model plugins shipped with Flare (registered through the `flare.models` entry point)."""
