"""The audit log: one structured line per call and per file URL use, never a secret."""
