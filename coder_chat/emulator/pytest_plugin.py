"""pytest fixtures for testing code against the chatd emulator (filled in by the emulator module)."""
