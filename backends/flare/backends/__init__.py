"""Backend plugins shipped with Flare: `cpu` (built in), `vulkan` and `cuda` (extras)."""
