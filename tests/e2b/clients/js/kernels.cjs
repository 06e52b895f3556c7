// The code-interpreter template's kernels through @e2b/code-interpreter's runCode (issue 37):
// R, a figure as a Python cell's last expression, and languages Corral has no kernel for
// (the SDK reads no body on a 400: the refusal must come as the cell's error).
// Usage: node kernels.cjs
'use strict'
const { Sandbox } = require('@e2b/code-interpreter')
const { step, done } = require('./_steps.cjs')

async function main() {
  const sb = await step('create', () => Sandbox.create({ timeoutMs: 240000 }), 90000)
  await step('id', async () => sb.sandboxId)
  const run = async (code, opts) => {
    const ex = await sb.runCode(code, opts)
    return { text: ex.text === undefined ? null : ex.text,
             error: ex.error ? { name: ex.error.name, value: ex.error.value } : null,
             results: ex.results.map((r) => ({ formats: r.formats(), isMain: r.isMainResult,
                                                pngHead: (r.png || '').slice(0, 12) })) }
  }
  await step('r', () => run('x <- 41\nx + 1', { language: 'r' }), 90000)
  await step('figure_last', () => run('import matplotlib.pyplot as plt\n' +
                                      'fig = plt.figure()\nplt.plot([1, 2])\nfig'), 90000)
  await step('java', () => run('System.out.println(1);', { language: 'java' }))
  await step('deno', () => run('1', { language: 'deno' }))
  await step('kill_sandbox', () => sb.kill())
  done()
}
main()
