"""Back-ends of the user commands in ``tools/`` (each module has a ``main``) and the local launcher."""
