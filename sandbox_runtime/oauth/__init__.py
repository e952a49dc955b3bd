"""OAuth 2.1 resource server (MCP authorization): protected resource metadata, access tokens
verified locally as JWTs against the issuer's keys or by introspection, identity to principal,
and the scopes each tool needs."""
