// Drives the E2B JS SDK (npm `e2b`), unmodified, against our server (tests/test_e2b_sdk.py).
// The SDK finds the server through E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY only. Prints
// one JSON object on stdout. Run from a directory whose node_modules holds the SDK (the test
// links .clients/e2b-node/node_modules beside a copy of this file).

import { createHash, randomBytes } from "node:crypto";
import { Sandbox, CommandExitError } from "e2b";

async function examples() {
  const out = {};
  const sandbox = await Sandbox.create({ metadata: { suite: "e2b-js" }, envs: { GREETING: "hello" } });
  out.sandboxId = sandbox.sandboxId;
  const result = await sandbox.commands.run("echo hi; echo oops >&2; echo $GREETING");
  out.run = { stdout: result.stdout, stderr: result.stderr, exit: result.exitCode };
  try {
    await sandbox.commands.run("exit 3");
    out.exit3 = null;
  } catch (error) {
    out.exit3 = error instanceof CommandExitError ? error.exitCode : String(error);
  }
  const seen = [];
  const background = await sandbox.commands.run("for i in 1 2 3; do echo line$i; sleep 0.1; done", {
    background: true,
    onStdout: (data) => seen.push(data),
  });
  const ended = await background.wait();
  out.background = { seen: seen.join(""), exit: ended.exitCode };
  const cat = await sandbox.commands.run("cat", { background: true, stdin: true });
  await sandbox.commands.sendStdin(cat.pid, "typed\n");
  await sandbox.commands.closeStdin(cat.pid);
  out.stdin = (await cat.wait()).stdout;
  const sleeper = await sandbox.commands.run("sleep 60", { background: true });
  out.killed = await sandbox.commands.kill(sleeper.pid);
  try {
    await sleeper.wait();
    out.afterKill = "finished normally";
  } catch (error) {
    out.afterKill = { exit: error.exitCode, error: error.error };
  }
  await sandbox.files.write("/home/user/notes.txt", "first");
  out.read = await sandbox.files.read("/home/user/notes.txt");
  out.list = (await sandbox.files.list("/home/user")).map((e) => e.name).sort();
  out.makeDir = [await sandbox.files.makeDir("/home/user/d"), await sandbox.files.makeDir("d")];
  out.rename = (await sandbox.files.rename("/home/user/notes.txt", "/home/user/d/renamed.txt")).path;
  await sandbox.files.remove("/home/user/d");
  out.removed = !(await sandbox.files.exists("d"));
  const data = randomBytes(50 * 1024 * 1024);
  await sandbox.files.write("big.bin", new Uint8Array(data).buffer);
  const back = await sandbox.files.read("big.bin", { format: "bytes" });
  out.bigMatches =
    createHash("sha256").update(back).digest("hex") === createHash("sha256").update(data).digest("hex");
  out.inList = (await Sandbox.list().nextItems()).some((s) => s.sandboxId === sandbox.sandboxId);
  await sandbox.files.write("kept.txt", "survives");
  await sandbox.pause();
  const resumed = await Sandbox.connect(sandbox.sandboxId);
  out.resumedRead = await resumed.files.read("kept.txt");
  out.kill = await resumed.kill();
  out.isRunning = await resumed.isRunning();
  return out;
}

try {
  console.log(JSON.stringify(await examples()));
} catch (error) {
  console.log(JSON.stringify({ crash: String(error), stack: error?.stack }));
}
