// JavaScript (and TypeScript) cells through @e2b/code-interpreter's runCode (issue 37): what the
// JS SDK's users send with {language: 'javascript'}. Usage: node js_cells.cjs
'use strict'
const { Sandbox } = require('@e2b/code-interpreter')
const { step, done } = require('./_steps.cjs')

async function main() {
  const sb = await step('create', () => Sandbox.create({ timeoutMs: 240000 }), 90000)
  await step('id', async () => sb.sandboxId)
  const run = async (code, opts) => {
    const ex = await sb.runCode(code, opts)
    return { text: ex.text === undefined ? null : ex.text, stdout: ex.logs.stdout,
             stderr: ex.logs.stderr,
             error: ex.error ? { name: ex.error.name, value: ex.error.value } : null,
             formats: ex.results.map((r) => r.formats()) }
  }
  const js = { language: 'javascript' }
  await step('expr', () => run('1 + 1', js), 90000) // may start the kernel
  await step('state_set', () => run('const answer = 41', js))
  await step('state_kept', () => run('answer + 1', js))
  await step('stdout', () => run("console.log('from js'); console.error('to err')", js))
  await step('error', () => run("throw new TypeError('boom')", js))
  await step('node', () => run('process.versions.node.split(".")[0]', js))
  await step('js_alias', () => run('[1, 2, 3].map((n) => n * 2).join(",")', { language: 'js' }))
  await step('python_beside', () => run('answer = "py"\nanswer'))
  await step('js_unchanged', () => run('answer', js))
  await step('context', async () => {
    const ctx = await sb.createCodeContext({ language: 'javascript', cwd: '/home/user' })
    await run('let y = 5', { context: ctx })
    const got = await run('y * 2', { context: ctx })
    const unseen = await run('typeof y', js)
    await sb.removeCodeContext(ctx)
    return { language: ctx.language, text: got.text, default_sees: unseen.text }
  })
  await step('typescript', () => run('const n: number = 21\nn * 2', { language: 'typescript' }))
  await step('kill_sandbox', () => sb.kill())
  done()
}
main()
