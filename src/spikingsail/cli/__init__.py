"""The ``sail`` command."""
