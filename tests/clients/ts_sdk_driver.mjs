// The TypeScript MCP SDK as a Node agent uses it: Client + StreamableHTTPClientTransport with
// an Authorization header. `--sdk v1` is @modelcontextprotocol/sdk 1.x (the 2025-11-25 era, what
// most Node tools ship today); `--sdk v2` is @modelcontextprotocol/client 2.x with
// versionNegotiation mode "auto" (2026-07-28 when the server offers it).
//
// 1. execute_code `sleep N; echo done` with {timeout: 5000, resetTimeoutOnProgress: true} and an
//    onprogress handler: it lives only if progress notifications keep coming.
// 2. The same server with a wrong token: the error a user sees.
// 3. With --typo-url (a hosted server's URL with a typo in its name): the error a user sees.
//
// Prints one JSON object on stdout. Run from a directory whose node_modules holds the SDKs
// (tests/test_frameworks.py links .clients/node/node_modules beside a copy of this file).

import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";

const { values: args } = parseArgs({
  options: {
    url: { type: "string" },
    token: { type: "string" },
    sdk: { type: "string", default: "v1" },
    sleep: { type: "string", default: "12" },
    timeout: { type: "string", default: "5000" },
    "typo-url": { type: "string" },
  },
});

// The installed version of a package: the package.json above the file a specifier resolves to
// (the packages' exports maps do not export their package.json).
function installedVersion(name, specifier) {
  let dir = dirname(fileURLToPath(import.meta.resolve(specifier)));
  while (dir !== dirname(dir)) {
    try {
      const pkg = JSON.parse(readFileSync(join(dir, "package.json"), "utf8"));
      if (pkg.name === name) return pkg.version;
    } catch {
      // no package.json here: go up
    }
    dir = dirname(dir);
  }
  return null;
}

async function loadSdk(which) {
  if (which === "v1") {
    const { Client } = await import("@modelcontextprotocol/sdk/client/index.js");
    const { StreamableHTTPClientTransport } = await import(
      "@modelcontextprotocol/sdk/client/streamableHttp.js"
    );
    return {
      version: installedVersion("@modelcontextprotocol/sdk", "@modelcontextprotocol/sdk/client/index.js"),
      newClient: () => new Client({ name: "srt-ts-driver", version: "1.0.0" }),
      call: (client, params, options) => client.callTool(params, undefined, options),
      protocol: (client, transport) => transport.protocolVersion ?? null,
      Transport: StreamableHTTPClientTransport,
    };
  }
  const { Client, StreamableHTTPClientTransport } = await import("@modelcontextprotocol/client");
  return {
    version: installedVersion("@modelcontextprotocol/client", "@modelcontextprotocol/client"),
    newClient: () =>
      new Client(
        { name: "srt-ts-driver", version: "1.0.0" },
        { versionNegotiation: { mode: "auto" } },
      ),
    call: (client, params, options) => client.callTool(params, options),
    protocol: (client) => client.getNegotiatedProtocolVersion?.() ?? null,
    Transport: StreamableHTTPClientTransport,
  };
}

function errorText(err) {
  if (!err) return null;
  const parts = [`${err.name ?? "Error"}: ${err.message ?? String(err)}`];
  if (err.code !== undefined) parts.push(`code=${err.code}`);
  if (err.cause) parts.push(`cause: ${errorText(err.cause)}`);
  return parts.join(" ");
}

function summarize(result) {
  const texts = (result.content ?? []).filter((c) => c.type === "text").map((c) => c.text);
  let payload = result.structuredContent ?? null;
  const textJson = texts.map((t) => {
    try {
      const parsed = JSON.parse(t);
      if (payload === null && parsed && typeof parsed === "object" && !Array.isArray(parsed)) {
        payload = parsed;
      }
      return true;
    } catch {
      return false;
    }
  });
  const key = Array.isArray(payload?.output) ? "output" : Array.isArray(payload?.events) ? "events" : null;
  const events = key ? payload[key] : [];
  return {
    is_error: Boolean(result.isError),
    status: payload?.status ?? null,
    exit_code: payload?.exit_code ?? null,
    session: payload?.session ?? null,
    stdout: events.filter((e) => e.type === "stdout").map((e) => e.data ?? "").join(""),
    output_key: key,
    text_blocks_json: textJson,
    text: texts.map((t) => t.slice(0, 2000)),
  };
}

async function connect(sdk, token, url = args.url) {
  const transport = new sdk.Transport(new URL(url), {
    requestInit: { headers: { Authorization: `Bearer ${token}` } },
  });
  const client = sdk.newClient();
  await client.connect(transport);
  return { client, transport };
}

async function main() {
  const report = { framework: "typescript-sdk", sdk: args.sdk, node: process.version };
  const sdk = await loadSdk(args.sdk);
  report.version = sdk.version;

  // 1. A call longer than its timeout, kept alive by progress notifications.
  try {
    const { client, transport } = await connect(sdk, args.token);
    report.protocol_version = sdk.protocol(client, transport);
    report.tools = (await client.listTools()).tools.map((t) => t.name).sort();
    const started = Date.now();
    const progress = [];
    try {
      const result = await sdk.call(
        client,
        { name: "execute_code", arguments: { command: `sleep ${args.sleep}; echo done` } },
        {
          timeout: Number(args.timeout),
          resetTimeoutOnProgress: true,
          onprogress: (p) => progress.push({ at_ms: Date.now() - started, ...p }),
        },
      );
      report.long_call = { ...summarize(result), exception: null };
    } catch (err) {
      report.long_call = { exception: errorText(err) };
    }
    const times = [0, ...progress.map((p) => p.at_ms), Date.now() - started];
    report.long_call.seconds = (Date.now() - started) / 1000;
    report.long_call.progress_count = progress.length;
    report.long_call.max_gap_ms = Math.max(...times.slice(1).map((t, i) => t - times[i]));
    report.long_call.progress = progress.slice(0, 50);
    await client.close();
  } catch (err) {
    report.connect = { exception: errorText(err) };
  }

  // 2. A wrong token.
  try {
    const { client } = await connect(sdk, `${args.token}-wrong`);
    await client.listTools();
    report.wrong_token = { exception: null };
    await client.close();
  } catch (err) {
    // The message is what most applications show; the 2.x SDK keeps the HTTP body in data.
    report.wrong_token = {
      exception: errorText(err),
      message: err?.message ?? String(err),
      status: err?.data?.status ?? (typeof err?.code === "number" ? err.code : null),
      body: err?.data?.text ?? null,
    };
  }

  // 3. A typo in a hosted server's URL.
  if (args["typo-url"]) {
    try {
      const { client } = await connect(sdk, args.token, args["typo-url"]);
      await client.listTools();
      report.url_typo = { exception: null };
      await client.close();
    } catch (err) {
      report.url_typo = { exception: errorText(err), message: err?.message ?? String(err) };
    }
  }
  return report;
}

main()
  .then((report) => {
    process.stdout.write(`${JSON.stringify(report)}\n`);
    process.exit(0);
  })
  .catch((err) => {
    process.stdout.write(`${JSON.stringify({ crash: errorText(err), stack: err?.stack ?? null })}\n`);
    process.exit(1);
  });
