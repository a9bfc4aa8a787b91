"""Helpers shared by several test directories (see each module)."""
