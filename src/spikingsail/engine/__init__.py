"""The engine and the calls that build it."""
