// E2B's JavaScript code-interpreter SDK (`@e2b/code-interpreter`, unmodified) under Node,
// against our server: only E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY point it here.
// `node e2b_interpreter_driver.mjs` (NODE_PATH: the node_modules that hold the SDK) runs
// E2B's documented examples once and prints what it saw as one JSON object
// (tests/test_e2b_interpreter.py asserts on it).
import { createRequire } from 'node:module'

const require = createRequire(process.env.NODE_PATH + '/')
const { Sandbox } = require('@e2b/code-interpreter')

const PANDAS_CHART = `
import pandas as pd
import matplotlib.pyplot as plt

df = pd.DataFrame({"x": [1, 2, 3], "y": [2, 4, 8]})
plt.bar(["a", "b", "c"], df["y"], label="y")
plt.title("Bars")
plt.show()
df
`

const sbx = await Sandbox.create()
const out = {}
try {
  const stdout = []
  const chart = await sbx.runCode(PANDAS_CHART, { onStdout: (m) => stdout.push(m.line) })
  out.results = chart.results.map((r) => ({
    main: r.isMainResult,
    png: r.png ? Buffer.from(r.png, 'base64').subarray(0, 8).toString('hex') : null,
    chart: r.chart ? { type: r.chart.type, title: r.chart.title, elements: r.chart.elements } : null,
    data: r.data ?? null,
  }))
  out.count = chart.executionCount

  const printed = []
  const streamed = await sbx.runCode("print('one')\nprint('two')", {
    onStdout: (m) => printed.push(m.line),
  })
  out.printed = printed
  out.logs = streamed.logs.stdout

  const failed = await sbx.runCode('raise ValueError("bad value")')
  out.error = { name: failed.error.name, value: failed.error.value, traceback: failed.error.traceback }

  const js = await sbx.runCode('const n = 20; n * 2', { language: 'javascript' })
  out.js = js.text

  const context = await sbx.createCodeContext({ language: 'python', cwd: '/home/user' })
  await sbx.runCode('z = 7', { context })
  const listed = await sbx.listCodeContexts()
  out.listed_last = listed[listed.length - 1].id === context.id
  out.z = (await sbx.runCode('z', { context })).text
  out.z_default = (await sbx.runCode('z')).error?.name ?? null
  await sbx.restartCodeContext(context)
  out.z_restarted = (await sbx.runCode('z', { context })).error?.name ?? null
  await sbx.removeCodeContext(context)
  out.removed = !(await sbx.listCodeContexts()).some((c) => c.id === context.id)
  try {
    // (The SDK clears its request timer only on success: after this refusal it would hold
    // Node open for the default 60 s. A shorter one, same call.)
    await sbx.runCode('1', { context, requestTimeoutMs: 5_000 })
    out.removed_run = 'ran'
  } catch (err) {
    out.removed_run = err.name
  }
} finally {
  await sbx.kill()
}
console.log(JSON.stringify(out))
