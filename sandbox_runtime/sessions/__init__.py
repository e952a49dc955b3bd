"""Sessions: state homed on one replica (workspaces, interpreters), reachable from every replica."""
