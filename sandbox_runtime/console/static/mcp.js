// A small MCP client of this server's /mcp endpoint, speaking the 2026-07-28 protocol
// (no initialize, no session id: every request carries the protocol version). JSON-RPC over
// Streamable HTTP; the answer is JSON or one SSE stream whose last message answers the call.

export const PROTOCOL = "2026-07-28";
const META = {
  "io.modelcontextprotocol/protocolVersion": PROTOCOL,
  "io.modelcontextprotocol/clientInfo": { name: "srt-console", version: "1" },
  "io.modelcontextprotocol/clientCapabilities": {},
};

export class AuthError extends Error {}
export class ToolError extends Error {}

export class McpClient {
  #token;
  #id = 0;

  // onUnauthorized: called when the server refuses the token (401) after it worked once
  // (an OAuth token that expired: the console signs in again).
  constructor(token, onUnauthorized = null) {
    this.url = new URL("/mcp", window.location.origin).href;
    this.#token = token; // sent in the Authorization header only, never in a URL
    this.onUnauthorized = onUnauthorized;
  }

  async request(method, params = {}, name = null) {
    const id = ++this.#id;
    const headers = {
      "Content-Type": "application/json",
      Accept: "application/json, text/event-stream",
      "Mcp-Protocol-Version": PROTOCOL,
      "Mcp-Method": method,
      Authorization: `Bearer ${this.#token}`,
    };
    if (name) headers["Mcp-Name"] = name;
    const response = await fetch(this.url, {
      method: "POST",
      headers,
      body: JSON.stringify({ jsonrpc: "2.0", id, method, params: { ...params, _meta: META } }),
      credentials: "omit",
      cache: "no-store",
      referrerPolicy: "no-referrer",
    });
    if (response.status === 401) {
      if (this.onUnauthorized) this.onUnauthorized();
      throw new AuthError("The server refused this token.");
    }
    if (response.status === 403) {
      // insufficient_scope: the JSON-RPC error says which scope and who grants it
      const refusal = await response.json().catch(() => null);
      throw new ToolError(refusal?.error?.message || "The server refused this call (HTTP 403).");
    }
    if (!response.ok) {
      const text = (await response.text()).slice(0, 300);
      throw new Error(`HTTP ${response.status} from /mcp: ${text}`);
    }
    const type = response.headers.get("content-type") || "";
    const message = type.includes("text/event-stream")
      ? lastMessage(await response.text(), id)
      : await response.json();
    if (!message) throw new Error(`no answer to ${method}`);
    if (message.error) throw new Error(message.error.message || JSON.stringify(message.error));
    return message.result;
  }

  discover() {
    return this.request("server/discover");
  }

  listTools() {
    return this.request("tools/list");
  }

  // A tool's structured result; ToolError with the tool's message when it reports an error.
  async call(tool, args) {
    const result = await this.request("tools/call", { name: tool, arguments: args }, tool);
    const text = (result.content || []).filter((c) => c.type === "text").map((c) => c.text).join("\n");
    if (result.isError) throw new ToolError(result.structuredContent?.error || text || `${tool} failed`);
    if (result.structuredContent) return result.structuredContent;
    try {
      return JSON.parse(text);
    } catch {
      return { text };
    }
  }
}

function lastMessage(stream, id) {
  let found = null;
  for (const block of stream.split(/\r?\n\r?\n/)) {
    const data = block
      .split(/\r?\n/)
      .filter((line) => line.startsWith("data:"))
      .map((line) => line.slice(5).trimStart())
      .join("\n");
    if (!data) continue;
    try {
      const message = JSON.parse(data);
      if (message.id === id) found = message;
    } catch {
      /* a keep-alive or partial block */
    }
  }
  return found;
}
