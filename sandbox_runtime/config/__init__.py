"""Every setting the server reads: from flags, the environment and `.env`, once at start-up.

settings.py: the `Settings` model (each field, its default, bounds and description, and the
checks across fields); parsing.py: the pure parsing of the settings' own small languages
(tokens, warm interpreters, DNS servers) and what is derived from them.
"""

from sandbox_runtime.config.command import cli_name as cli_name
from sandbox_runtime.config.settings import REPLICA_ID as REPLICA_ID
from sandbox_runtime.config.settings import Settings as Settings
