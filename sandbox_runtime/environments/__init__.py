"""Environments: read-only root filesystems that sandboxes run on (DESIGN §21)."""
