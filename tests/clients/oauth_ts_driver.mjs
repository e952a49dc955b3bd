// The official TypeScript MCP SDK signing in by OAuth as a Node app does: an OAuthClientProvider
// on the Streamable HTTP transport. `--sdk v1` is @modelcontextprotocol/sdk 1.x, `--sdk v2` the
// 2.x client package (versionNegotiation "auto": the 2026-07-28 era when offered). The server's 401
// sends it through discovery, dynamic registration and authorization code + PKCE; the
// "browser" is the test: this driver prints {"authorize": URL} on stdout and reads back, on
// stdin, the URL the provider redirected to (with the code). Then it calls execute_code.
//
// Prints one JSON report on stdout last. Run from a directory whose node_modules holds the
// SDK (tests/test_oauth_clients.py links .clients/node/node_modules beside a copy of this file).

import { createInterface } from "node:readline";
import { parseArgs } from "node:util";

const { values: args } = parseArgs({
  options: { url: { type: "string" }, sdk: { type: "string", default: "v1" } },
});

async function loadSdk(which) {
  if (which === "v1") {
    const { Client } = await import("@modelcontextprotocol/sdk/client/index.js");
    const { UnauthorizedError } = await import("@modelcontextprotocol/sdk/client/auth.js");
    const { StreamableHTTPClientTransport } = await import(
      "@modelcontextprotocol/sdk/client/streamableHttp.js"
    );
    return {
      newClient: () => new Client({ name: "srt-oauth-ts", version: "0.0.0" }),
      UnauthorizedError,
      Transport: StreamableHTTPClientTransport,
      finish: (transport, landed) => transport.finishAuth(landed.searchParams.get("code")),
    };
  }
  const { Client, StreamableHTTPClientTransport, UnauthorizedError } = await import(
    "@modelcontextprotocol/client"
  );
  return {
    newClient: () =>
      new Client({ name: "srt-oauth-ts", version: "0.0.0" }, { versionNegotiation: { mode: "auto" } }),
    UnauthorizedError,
    Transport: StreamableHTTPClientTransport,
    // (the callback's parameters: the SDK checks `iss` (RFC 9207) before it reads the code)
    finish: (transport, landed) => transport.finishAuth(landed.searchParams),
  };
}
const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();
const report = { authorize: [], registered: null, tokens: null };

class TestAuth {
  constructor() {
    this.saved = {};
  }
  get redirectUrl() {
    return "http://127.0.0.1:3031/callback"; // (never reached: the test reads the redirect)
  }
  get clientMetadata() {
    return {
      client_name: "srt-tests (TypeScript SDK)",
      redirect_uris: [this.redirectUrl],
      grant_types: ["authorization_code", "refresh_token"],
      response_types: ["code"],
      token_endpoint_auth_method: "none",
    };
  }
  clientInformation() {
    return this.saved.client;
  }
  saveClientInformation(client) {
    this.saved.client = client;
    report.registered = client.client_id;
  }
  tokens() {
    return this.saved.tokens;
  }
  saveTokens(tokens) {
    this.saved.tokens = tokens;
    report.tokens = { scope: tokens.scope, token_type: tokens.token_type };
  }
  redirectToAuthorization(url) {
    report.authorize.push(url.href);
    process.stdout.write(`${JSON.stringify({ authorize: url.href })}\n`);
  }
  saveCodeVerifier(verifier) {
    this.saved.verifier = verifier;
  }
  codeVerifier() {
    return this.saved.verifier;
  }
}

async function connect(sdk, auth) {
  const client = sdk.newClient();
  const transport = new sdk.Transport(new URL(args.url), { authProvider: auth });
  await client.connect(transport);
  return { client, transport };
}

try {
  const sdk = await loadSdk(args.sdk);
  const auth = new TestAuth();
  let connected;
  try {
    connected = await connect(sdk, auth);
  } catch (err) {
    if (!(err instanceof sdk.UnauthorizedError)) throw err;
    // The redirect the test's sign-in ended with: hand its code to the transport.
    const landed = new URL((await lines.next()).value);
    const transport = new sdk.Transport(new URL(args.url), { authProvider: auth });
    await sdk.finish(transport, landed);
    connected = await connect(sdk, auth);
  }
  const result = await connected.client.callTool({
    name: "execute_code",
    arguments: { command: "echo from typescript", session: "ts-sdk" },
  });
  report.is_error = Boolean(result.isError);
  report.structured = result.structuredContent;
  await connected.client.close();
  process.stdout.write(`${JSON.stringify(report)}\n`);
  process.exit(0);
} catch (err) {
  report.crash = String(err);
  report.stack = err && err.stack;
  process.stdout.write(`${JSON.stringify(report)}\n`);
  process.exit(1);
}
