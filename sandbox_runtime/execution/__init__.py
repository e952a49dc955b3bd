"""Executions: their records, events, processes and the manager that owns them."""
