// Scenarios 5-6 through the official JS SDKs: files.watchDir (the WatchDir stream) and
// @e2b/code-interpreter runCode. Usage: node watch_code.cjs
'use strict'
const { Sandbox } = require('@e2b/code-interpreter')
const { step, done } = require('./_steps.cjs')

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

async function main() {
  const sb = await step('create', () => Sandbox.create({ timeoutMs: 240000 }), 90000)
  await step('id', async () => sb.sandboxId)
  await step('watch', async () => {
    await sb.files.makeDir('/home/user/w')
    const got = []
    const h = await sb.files.watchDir('/home/user/w', (e) => got.push([e.name, e.type]), { timeoutMs: 30000 })
    await sb.files.write('/home/user/w/x.txt', 'x')
    await sb.commands.run('rm /home/user/w/x.txt')
    for (let i = 0; i < 40 && !got.some(([, t]) => t === 'remove'); i++) await sleep(50)
    await h.stop()
    return got
  })
  const run = async (code, opts) => {
    const ex = await sb.runCode(code, opts)
    return { text: ex.text, count: ex.executionCount, stdout: ex.logs.stdout,
             error: ex.error ? { name: ex.error.name, value: ex.error.value } : null,
             formats: ex.results.map((r) => r.formats()) }
  }
  await step('first_cell', () => run('x = 1'), 90000)
  await step('state_kept', () => run('x + 1'))
  await step('stdout', () => run('print("to out")'))
  await step('zero_division', () => run('1/0'))
  await step('png', () => run("import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()"), 90000)
  await step('contexts', async () => {
    const ctx = await sb.createCodeContext({ cwd: '/home/user' })
    await run('y = 5', { context: ctx })
    const got = await run('y', { context: ctx })
    const listed = (await sb.listCodeContexts()).map((c) => c.id)
    await sb.removeCodeContext(ctx)
    return { text: got.text, listed: listed.includes(ctx.id) }
  })
  await step('kill_sandbox', () => sb.kill())
  done()
}
main()
