"""The composition root (services.py): the process's parts, built and wired in one place."""
