"""Diagnostics: the cluster doctor (``sail doctor``) and the communication benchmark (``sail bench comm``).

The doctor collects facts with ``probe.py`` — a standard-library-only script run by the Python
that training uses, on this machine or over ssh on every node — and turns them into findings
(``machine.py`` for one machine, ``nodes.py`` for what the nodes must agree on).
"""
