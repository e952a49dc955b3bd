"""Execution state beyond this process: the store interface, in-memory and Redis stores."""
