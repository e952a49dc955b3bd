"""Snapshots of sessions: workspaces kept in a store, restored on another replica (DESIGN 17)."""
