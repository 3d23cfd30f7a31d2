"""Launchers turn a launch request into commands (host, argv, env) before anything runs."""
