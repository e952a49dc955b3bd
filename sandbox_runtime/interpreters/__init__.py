"""Code interpreters: persistent Jupyter kernels per session, inside sandboxes (DESIGN §8)."""
