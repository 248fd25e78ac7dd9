"""flare-backend-mirror: an example third-party Flare backend (see docs/write-a-backend.md).

`flare_mirror.plugin` is the entry point the plugin manager loads;
`flare_mirror.device` holds the backend, its devices and its compiled programs.
"""
__version__ = "0.1.0"
