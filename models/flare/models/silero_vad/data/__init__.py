"""Data shipped with the silero-vad plugin (a package so setuptools ships the WAV)."""
