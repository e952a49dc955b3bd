// The console: sign in, run code and commands with streamed output, answer input, cancel,
// reopen past executions, move workspace files. Everything goes through /mcp (mcp.js) with
// the user's token; nothing is loaded from another origin and nothing runs inline.
import { AuthError, McpClient } from "./mcp.js";
import { finishSignIn, isCallback, oauthConfig, startSignIn } from "./oauth.js";

const $ = (id) => document.getElementById(id);
const STORE_TOKEN = "srt-console-token";
const STORE_SESSION = "srt-console-session";
const STORE_KIND = "srt-console-kind"; // "oauth": signed in with the identity provider
const STORE_SINCE = "srt-console-since"; // when that token was given (ms)
// A token refused this soon after the provider gave it is not an expired one: no new
// sign-in then (it would loop), the error is shown instead.
const FRESH_MS = 15000;
const FINISHED = new Set(["completed", "failed", "timeout", "cancelled", "lost"]);
const ANSI = /\x1b\[[0-9;?]*[A-Za-z]/g;

let client = null;
let session = "console";
let current = null; // {id, cursor, awaitingInput}
let followSerial = 0;
let statusTimer = null;
let listTimer = null;
let config = { oauth: null, callback: "/console/callback" };

// -- sign in ------------------------------------------------------------------------------

async function signIn(token, name, kind = "token") {
  const candidate = new McpClient(token);
  await candidate.listTools(); // AuthError for a token the server refuses (shown)
  if (kind === "oauth") candidate.onUnauthorized = expired; // later: sign in again
  client = candidate;
  session = name;
  sessionStorage.setItem(STORE_KIND, kind);
  sessionStorage.setItem(STORE_TOKEN, token);
  sessionStorage.setItem(STORE_SESSION, name);
  $("signin").hidden = true;
  $("app").hidden = false;
  $("status").hidden = false;
  $("token").value = "";
  refreshStatus();
  statusTimer = setInterval(refreshStatus, 5000);
  listTimer = setInterval(() => refreshExecutions().catch(() => {}), 3000);
  await Promise.all([refreshExecutions(), refreshFiles()]);
  $("code").focus();
}

// The identity provider's token was refused (it expired or was revoked): sign in again there
// (its own session usually makes that a round trip with no typing).
function expired() {
  const since = Number(sessionStorage.getItem(STORE_SINCE) || 0);
  const name = sessionStorage.getItem(STORE_SESSION) || session;
  signOut();
  if (!config.oauth || Date.now() - since < FRESH_MS) {
    showSigninError("Sign in again: the server refused the identity provider's token.");
    return;
  }
  startSignIn(config.oauth, config.callback, name).catch((error) =>
    showSigninError(`Could not reach the identity provider: ${error.message}`),
  );
}

function signOut() {
  sessionStorage.removeItem(STORE_TOKEN);
  sessionStorage.removeItem(STORE_KIND);
  clearInterval(statusTimer);
  clearInterval(listTimer);
  client = null;
  current = null;
  $("app").hidden = true;
  $("status").hidden = true;
  $("signin").hidden = false;
  $("token").focus();
}

function showSigninError(text) {
  const box = $("signin-error");
  box.textContent = text;
  box.hidden = false;
}

$("signin").addEventListener("submit", async (event) => {
  event.preventDefault();
  $("signin-error").hidden = true;
  const token = $("token").value.trim();
  const name = $("session").value.trim() || "console";
  if (!token) return showSigninError("Enter a token.");
  try {
    await signIn(token, name);
  } catch (error) {
    showSigninError(
      error instanceof AuthError
        ? "Wrong token: the server refused it."
        : `Could not reach the server: ${error.message}`,
    );
  }
});
$("signout").addEventListener("click", signOut);
$("signin-oauth").addEventListener("click", async () => {
  $("signin-error").hidden = true;
  const name = $("session").value.trim() || "console";
  try {
    await startSignIn(config.oauth, config.callback, name);
  } catch (error) {
    showSigninError(`Could not reach the identity provider: ${error.message}`);
  }
});

// -- status strip -------------------------------------------------------------------------

async function refreshStatus() {
  try {
    const health = await (await fetch("/health", { cache: "no-store" })).json();
    $("status-replica").textContent = health.replica_id ?? "?";
    $("status-running").textContent = String(health.running_executions ?? "?");
    $("status-redis").textContent = health.redis ?? "?";
    $("status-egress").textContent = health.egress ?? "?";
  } catch {
    $("status-replica").textContent = "unreachable";
  }
}

// -- running ------------------------------------------------------------------------------

async function run() {
  if (!client) return;
  const language = $("language").value;
  const code = $("code").value;
  clearOutput();
  setRunning(true);
  try {
    const started =
      language === "shell"
        ? await client.call("execute_code_async", { command: code, interactive: true, session })
        : await client.call("run_code_async", { code, language, session });
    refreshExecutions().catch(() => {});
    await follow(started.execution_id, language === "shell");
  } catch (error) {
    appendText("out-error", `${error.message}\n`);
    setRunning(false);
  }
}

// Stream an execution's events into the output until it ends (long-polls get_execution_output).
async function follow(executionId, shell = false) {
  const serial = ++followSerial;
  current = { id: executionId, cursor: "0", awaitingInput: false, shell };
  setRunning(true);
  for (;;) {
    let page;
    try {
      page = await client.call("get_execution_output", {
        execution_id: executionId,
        last_event_id: current.cursor,
        wait: true,
        wait_for: "output",
        wait_seconds: 15,
        session,
      });
    } catch (error) {
      if (serial !== followSerial) return;
      appendText("out-error", `${error.message}\n`);
      break;
    }
    if (serial !== followSerial) return; // another run or a reopened execution took over
    for (const event of page.output || []) render(event);
    current.cursor = page.next_cursor ?? current.cursor;
    if (FINISHED.has(page.status) && !page.has_more) {
      finish(page);
      break;
    }
  }
  setRunning(false);
  refreshExecutions().catch(() => {});
  refreshFiles().catch(() => {});
}

function finish(page) {
  const parts = [page.status];
  if (page.exit_code !== null && page.exit_code !== undefined) parts.push(`exit ${page.exit_code}`);
  if (page.signal) parts.push(page.signal);
  if (page.reason) parts.push(page.reason);
  if (page.duration_ms !== null && page.duration_ms !== undefined) parts.push(`${page.duration_ms} ms`);
  appendText("out-exit", `— ${parts.join(", ")}`);
}

function render(event) {
  switch (event.type) {
    case "stdout":
    case "stderr":
      appendText(`out-${event.type}`, event.data ?? "");
      break;
    case "result":
      renderBundle(event.bundle || {});
      break;
    case "exception":
      appendText(
        "out-error",
        `${(event.traceback || [`${event.name}: ${event.value}`]).join("\n").replace(ANSI, "")}\n`,
      );
      break;
    case "input_request":
      current.awaitingInput = true;
      appendText("out-prompt", event.prompt ?? "");
      $("stdin").focus();
      break;
    case "error":
    case "timeout":
    case "cancelled":
    case "resource_limit":
    case "truncated":
      appendText("out-note", `[${event.type}] ${event.message ?? event.reason ?? ""}\n`);
      break;
    case "network_denied":
      appendText("out-note", `[network denied] ${event.message ?? ""}\n`);
      break;
    case "network_secret":
      appendText("out-note", `[secret] ${event.message ?? ""}\n`);
      break;
    default:
      break; // ready, exit: the final line says how it ended
  }
}

function renderBundle(bundle) {
  for (const type of ["image/png", "image/jpeg", "image/gif"]) {
    if (bundle[type]) {
      const img = document.createElement("img");
      img.className = "out-image";
      img.alt = bundle["text/plain"] || "image output";
      img.src = `data:${type};base64,${String(bundle[type]).replace(/\s/g, "")}`;
      return appendNode(img);
    }
  }
  if (bundle["image/svg+xml"] || bundle["text/html"]) {
    // Rendered in a sandboxed frame: no scripts, no same origin (it cannot read this page,
    // its storage or its token).
    const frame = document.createElement("iframe");
    frame.className = "out-html";
    frame.setAttribute("sandbox", "");
    frame.setAttribute("title", "HTML output");
    frame.setAttribute("referrerpolicy", "no-referrer");
    frame.srcdoc = bundle["text/html"] || bundle["image/svg+xml"];
    return appendNode(frame);
  }
  if (bundle["text/plain"] !== undefined) appendText("out-stdout", `${bundle["text/plain"]}\n`);
  else appendText("out-note", `[${Object.keys(bundle).join(", ")}]\n`);
}

function clearOutput() {
  $("output").replaceChildren();
}

function appendText(kind, text) {
  const out = $("output");
  const last = out.lastElementChild;
  if (last && last.tagName === "SPAN" && last.className === kind) {
    last.textContent += text;
  } else {
    const span = document.createElement("span");
    span.className = kind;
    span.textContent = text;
    out.append(span);
  }
  out.scrollTop = out.scrollHeight;
}

function appendNode(node) {
  const out = $("output");
  out.append(node);
  out.scrollTop = out.scrollHeight;
}

function setRunning(running) {
  $("output").dataset.state = running ? "running" : "done";
  $("cancel").disabled = !running;
  $("stdin").disabled = !running;
  $("send-stdin").disabled = !running;
  $("close-stdin").disabled = !running || !current?.shell;
  $("run").disabled = running;
}

$("run").addEventListener("click", run);
$("code").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
    event.preventDefault();
    if (!$("run").disabled) run();
  }
});
$("cancel").addEventListener("click", async () => {
  if (!current) return;
  try {
    await client.call("cancel_execution", { execution_id: current.id, session });
  } catch (error) {
    appendText("out-error", `${error.message}\n`);
  }
});
$("stdin-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  if (!current) return;
  const text = $("stdin").value;
  $("stdin").value = "";
  if (current.awaitingInput) appendText("out-prompt", `${text}\n`);
  current.awaitingInput = false;
  try {
    await client.call("send_stdin", { execution_id: current.id, input_data: `${text}\n`, session });
  } catch (error) {
    appendText("out-error", `${error.message}\n`);
  }
});

$("close-stdin").addEventListener("click", async () => {
  if (!current) return;
  const text = $("stdin").value;
  $("stdin").value = "";
  try {
    await client.call("send_stdin", { execution_id: current.id, input_data: text, close_stdin: true, append_newline: false, session });
    $("close-stdin").disabled = true;
  } catch (error) {
    appendText("out-error", `${error.message}\n`);
  }
});

// -- executions ---------------------------------------------------------------------------

async function refreshExecutions() {
  if (!client) return;
  const listed = await client.call("list_executions", { limit: 30, session });
  const items = listed.result || [];
  const list = $("executions");
  list.replaceChildren(
    ...items.map((info) => {
      const li = document.createElement("li");
      li.dataset.executionId = info.id;
      li.dataset.status = info.status;
      const badge = document.createElement("span");
      badge.className = "badge";
      badge.textContent = info.status;
      const what = document.createElement("span");
      what.className = "what";
      const command = Array.isArray(info.command) ? info.command.join(" ") : String(info.command ?? "");
      what.textContent = (info.language ? `${info.language}: ` : "") + command.slice(0, 80);
      const facts = document.createElement("span");
      const bits = [];
      if (info.exit_code !== null && info.exit_code !== undefined) bits.push(`exit ${info.exit_code}`);
      if (info.duration_ms !== null && info.duration_ms !== undefined) bits.push(`${info.duration_ms} ms`);
      facts.textContent = bits.join(" · ");
      const reopen = document.createElement("button");
      reopen.type = "button";
      reopen.className = "reopen";
      reopen.textContent = "Open";
      reopen.setAttribute("aria-label", `Open the output of ${info.id}`);
      reopen.addEventListener("click", (event) => {
        event.stopPropagation();
        reopenExecution(info);
      });
      li.addEventListener("click", () => reopenExecution(info));
      li.append(badge, what, facts, reopen);
      return li;
    }),
  );
}

async function reopenExecution(info) {
  clearOutput();
  await follow(info.id, !info.language && info.interactive);
}

// -- files --------------------------------------------------------------------------------

async function refreshFiles() {
  if (!client) return;
  $("files-error").hidden = true;
  let listed;
  try {
    listed = await client.call("list_files", { path: ".", depth: 2, session });
  } catch (error) {
    $("files-error").textContent = error.message;
    $("files-error").hidden = false;
    return;
  }
  const entries = (listed.entries || []).filter((e) => !e.path.split("/").some((p) => p.startsWith(".")));
  $("files").replaceChildren(...entries.map(fileRow));
}

function fileRow(entry) {
  const li = document.createElement("li");
  li.dataset.path = entry.path;
  const name = document.createElement("span");
  name.className = "name";
  name.textContent = entry.type === "directory" ? `${entry.path}/` : entry.path;
  li.append(name);
  if (entry.type === "file") {
    const size = document.createElement("span");
    size.textContent = `${entry.size} B`;
    const download = document.createElement("a");
    download.className = "download";
    download.href = "#";
    download.textContent = "Download";
    download.setAttribute("aria-label", `Download ${entry.path}`);
    download.addEventListener("click", (event) => {
      event.preventDefault();
      downloadFile(entry.path).catch(showFilesError);
    });
    li.append(size, download);
  }
  const remove = document.createElement("button");
  remove.type = "button";
  remove.className = "delete";
  remove.textContent = "Delete";
  remove.setAttribute("aria-label", `Delete ${entry.path}`);
  remove.addEventListener("click", async () => {
    if (!window.confirm(`Delete ${entry.path}?`)) return;
    try {
      await client.call("delete_file", { path: entry.path, recursive: entry.type === "directory", session });
      await refreshFiles();
    } catch (error) {
      showFilesError(error);
    }
  });
  li.append(remove);
  return li;
}

function showFilesError(error) {
  $("files-error").textContent = error.message;
  $("files-error").hidden = false;
}

async function downloadFile(path) {
  const signed = await client.call("create_file_url", { path, method: "GET", expires_in_seconds: 300, session });
  const link = document.createElement("a");
  link.href = signed.url; // a signed /files/ URL: it carries no token of the user's
  link.download = path.split("/").pop();
  link.rel = "noopener";
  document.body.append(link);
  link.click();
  link.remove();
}

async function upload(files) {
  for (const file of files) {
    try {
      const signed = await client.call("create_file_url", {
        path: file.name,
        method: "PUT",
        expires_in_seconds: 600,
        session,
      });
      const response = await fetch(signed.url, { method: "PUT", body: file, credentials: "omit" });
      if (!response.ok) throw new Error(`upload of ${file.name}: HTTP ${response.status} ${await response.text()}`);
    } catch (error) {
      showFilesError(error);
    }
  }
  await refreshFiles();
}

$("upload").addEventListener("change", () => {
  const files = [...$("upload").files];
  $("upload").value = "";
  upload(files);
});
$("refresh-files").addEventListener("click", () => refreshFiles());
const zone = $("dropzone");
zone.addEventListener("dragover", (event) => {
  event.preventDefault();
  zone.classList.add("over");
});
zone.addEventListener("dragleave", () => zone.classList.remove("over"));
zone.addEventListener("drop", (event) => {
  event.preventDefault();
  zone.classList.remove("over");
  upload([...event.dataTransfer.files]);
});

// -- start --------------------------------------------------------------------------------

async function start() {
  config = await oauthConfig().catch(() => config);
  if (config.oauth) {
    const provider = new URL(config.oauth.issuer).host;
    $("signin-oauth").textContent = `Sign in with ${provider}`;
    $("signin-oauth").hidden = false;
  }
  $("session").value = sessionStorage.getItem(STORE_SESSION) || "console";
  if (config.oauth && isCallback(config.callback)) {
    try {
      const signed = await finishSignIn(config.oauth);
      sessionStorage.setItem(STORE_SINCE, String(Date.now()));
      $("session").value = signed.session || $("session").value;
      await signIn(signed.token, $("session").value, "oauth");
    } catch (error) {
      showSigninError(
        error instanceof AuthError
          ? "The server refused the identity provider's token."
          : `Sign-in failed: ${error.message}`,
      );
    }
    return;
  }
  if (window.location.pathname !== "/") window.history.replaceState(null, "", "/");
  const saved = sessionStorage.getItem(STORE_TOKEN);
  if (saved) {
    const kind = sessionStorage.getItem(STORE_KIND) || "token";
    signIn(saved, $("session").value, kind).catch((error) => {
      if (kind === "oauth" && error instanceof AuthError) return expired();
      sessionStorage.removeItem(STORE_TOKEN);
      showSigninError("Sign in again: the saved token no longer works.");
    });
  } else {
    $("token").focus();
  }
}

start();
