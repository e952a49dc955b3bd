// Call the hosted MCP servers from JavaScript or TypeScript in the sandbox (code mode).
//
//   import { memory, server, search, servers } from "mcp_servers";
//   const graph = await memory.read_graph();
//   const sum = await server("everything")["get-sum"]({ a: 1, b: 2 });
//
// A call resolves to the tool's structured content when it has one, else its text (one
// text block), else its content blocks. A tool error rejects with ToolError; a call the host
// refuses (a server or tool not allowed, a limit) with BridgeError (`kind` says why). Errors
// are made where the caller awaits, and their stacks show the caller's lines, not ours.
// Deno finds the package by its bare name through the sandbox's /deno.json (an import map).
// Calls go over a Unix socket to the host, which checks each and calls the server on the
// principal's behalf: no credential is in this sandbox. Node's standard library only.
import fs from "node:fs";
import net from "node:net";
import path from "node:path";

const SOCKET = process.env.MCP_SERVERS_SOCKET ?? "/run/srt-bridge/bridge.sock";
const MAX_FRAME = 64 * 1024 * 1024;

// A stack without this package's frames (nor the runtime's own): the caller's lines.
function callersStack(error) {
  const lines = String(error.stack ?? "").split("\n");
  const kept = lines.slice(1).filter((l) => !l.includes("mcp_servers/index.mjs") && !/\(node:|at node:|ext:/.test(l));
  return [`${error.name}: ${error.message}`, ...kept].join("\n");
}

export class BridgeError extends Error {
  constructor(kind, message) {
    super(message);
    this.name = "BridgeError";
    this.kind = kind;
    this.stack = callersStack(this);
  }
}

export class ToolError extends Error {
  constructor(message, result) {
    super(message);
    this.name = "ToolError";
    this.stack = callersStack(this);
    Object.defineProperty(this, "result", { value: result, enumerable: false, writable: true });
  }
}

// A refusal as it came, made into a BridgeError by the async caller (so that its stack holds
// the code that awaited the call).
class Refusal {
  constructor(kind, message) {
    this.kind = kind;
    this.message = String(message).split(/\s+/).join(" ").trim();  // (one line)
  }
}

// The host refuses an execution's calls past 8 at once: here the others wait their turn
// (Promise.all over many calls), in the order they were made.
const CONCURRENT = 8;
let running = 0;
const waiting = [];

async function ask(request) {
  if (running >= CONCURRENT) await new Promise((go) => waiting.push(go));  // (a slot handed over)
  else running += 1;
  try {
    return await send(request);
  } catch (err) {
    if (err instanceof Refusal) throw new BridgeError(err.kind, err.message);
    throw err;
  } finally {
    const next = waiting.shift();
    if (next) next();  // (this slot, to the next in line)
    else running -= 1;
  }
}

function send(request) {
  return new Promise((resolve, reject) => {
    const sock = net.createConnection({ path: SOCKET });
    const chunks = [];
    let have = 0;
    sock.on("connect", () => {
      const body = Buffer.from(JSON.stringify(request));
      const head = Buffer.alloc(4);
      head.writeUInt32BE(body.length);
      sock.write(Buffer.concat([head, body]));
    });
    sock.on("data", (data) => {
      chunks.push(data);
      have += data.length;
      if (have < 4) return;
      const buffer = Buffer.concat(chunks);
      const size = buffer.readUInt32BE(0);
      if (size > MAX_FRAME) {
        sock.destroy();
        reject(new Refusal("protocol", `an answer of ${size} bytes`));
      } else if (buffer.length >= 4 + size) {
        sock.destroy();
        let answer;
        try {
          answer = JSON.parse(buffer.subarray(4, 4 + size).toString("utf8"));
        } catch (err) {
          reject(new Refusal("protocol", String(err)));
          return;
        }
        if (answer.ok) {
          if (typeof answer.file === "string") keep(answer.file, answer.result);
          resolve(answer.result);
        }
        else {
          const error = answer.error ?? {};
          reject(new Refusal(String(error.kind ?? "error"), String(error.message ?? "refused")));
        }
      }
    });
    sock.on("error", () => {
      const fix = typeof request.server === "string" ? JSON.stringify([request.server]) : "[...]";
      reject(new Refusal("unavailable", "no MCP servers bridge in this sandbox (this call " +
        `names no servers: call again with servers=${fix})`));
    });
    sock.on("close", () => reject(new Refusal("closed", "the host closed the bridge")));
  });
}

// A large result, kept in the workspace too (the host names the file): a later call or the
// agent reads it there instead of calling the tool again.
function keep(file, result) {
  try {
    fs.mkdirSync(path.dirname(file), { recursive: true });
    fs.writeFileSync(file, JSON.stringify(result));
  } catch {
    // (a full or read-only workspace: the value is still returned)
  }
}

function value(result) {
  const content = result.content ?? [];
  const texts = content.filter((b) => b.type === "text").map((b) => b.text ?? "");
  if (result.isError) throw new ToolError(texts.join("\n") || "the tool failed", result);
  if (result.structuredContent !== undefined && result.structuredContent !== null) {
    return result.structuredContent;
  }
  if (content.length === 1 && texts.length === 1) return texts[0];
  return content;
}

/** A server: each property is one of its tools, an async function of its arguments. */
export function server(name) {
  return new Proxy(
    {},
    {
      get(_target, tool) {
        if (typeof tool !== "string" || tool === "then") return undefined;
        if (tool === "tools") return () => ask({ op: "tools", server: name });
        return async (args = {}) =>
          value(await ask({ op: "call", server: name, tool, arguments: args }));
      },
    },
  );
}

/** The servers this code may call. */
export function servers() {
  return ask({ op: "servers" });
}

/** Tools whose name or description has every word of `query`; detail: names, summary, full. */
export function search(query, detail = "summary", limit = 20) {
  return ask({ op: "search", query, detail, limit });
}
