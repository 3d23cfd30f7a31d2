"""The documentation: its snippets run, its reference pages cover the code, the built site works offline."""
