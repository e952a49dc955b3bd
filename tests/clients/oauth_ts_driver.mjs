// The official TypeScript MCP SDK (@modelcontextprotocol/sdk 1.x) signing in by OAuth as a
// Node app does: an OAuthClientProvider on the Streamable HTTP transport. The server's 401
// sends it through discovery, dynamic registration and authorization code + PKCE; the
// "browser" is the test: this driver prints {"authorize": URL} on stdout and reads back, on
// stdin, the URL the provider redirected to (with the code). Then it calls execute_code.
//
// Prints one JSON report on stdout last. Run from a directory whose node_modules holds the
// SDK (tests/test_oauth_clients.py links .clients/node/node_modules beside a copy of this file).

import { createInterface } from "node:readline";
import { parseArgs } from "node:util";

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { UnauthorizedError } from "@modelcontextprotocol/sdk/client/auth.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const { values: args } = parseArgs({ options: { url: { type: "string" } } });
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

async function connect(auth) {
  const client = new Client({ name: "srt-oauth-ts", version: "0.0.0" });
  const transport = new StreamableHTTPClientTransport(new URL(args.url), { authProvider: auth });
  await client.connect(transport);
  return { client, transport };
}

try {
  const auth = new TestAuth();
  let connected;
  try {
    connected = await connect(auth);
  } catch (err) {
    if (!(err instanceof UnauthorizedError)) throw err;
    // The redirect the test's sign-in ended with: hand its code to the transport.
    const landed = new URL((await lines.next()).value);
    report.state_matches = landed.searchParams.get("state") === null ? null : true;
    const transport = new StreamableHTTPClientTransport(new URL(args.url), { authProvider: auth });
    await transport.finishAuth(landed.searchParams.get("code"));
    connected = await connect(auth);
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
