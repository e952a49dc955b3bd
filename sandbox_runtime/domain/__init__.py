"""Domain types: what every layer above speaks of (an owner and its workspace name, an
execution's models, a sandbox's limits, an egress policy). Pure: no I/O, no other layer."""
