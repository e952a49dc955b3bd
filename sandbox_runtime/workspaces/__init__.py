"""The sessions' workspaces: a filesystem image per session, made, mounted, capped, checked,
repaired and retired (store.py), and the file operations inside one that never follow a link
out of it (fsops.py). Below the execution layer: the manager and the sandboxes use them."""
