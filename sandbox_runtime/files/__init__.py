"""Workspace files: safe host-side access, quotas, tools, resources and signed URLs."""
