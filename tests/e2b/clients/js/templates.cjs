// E2B's JS Template SDK (the one @mastra/e2b builds with) against Corral's template-build API,
// then a sandbox of the template by name. Usage: node templates.cjs BASE_IMAGE
'use strict'
const fs = require('node:fs')
const os = require('node:os')
const path = require('node:path')
const { Sandbox, Template } = require('e2b')
const { step, done } = require('./_steps.cjs')

async function main() {
  const base = process.argv[2]
  const context = fs.mkdtempSync(path.join(os.tmpdir(), 'e2b-js-template-'))
  fs.writeFileSync(path.join(context, 'hello.txt'), 'hello from the JS SDK\n')
  const template = Template({ fileContextPath: context })
    .fromImage(base)
    .setEnvs({ FROM_JS: 'yes' })
    .copy('hello.txt', '/opt/js/')
    .runCmd('cat /opt/js/hello.txt > /opt/js/built.txt && echo "$FROM_JS" >> /opt/js/built.txt')
    .runCmd("printf '#!/bin/sh\\nexec /bin/sh \"$@\"\\n' > /bin/bash && chmod 755 /bin/bash",
            { user: 'root' })
  await step('build', async () => {
    const logs = []
    const started = Date.now()
    const info = await Template.build(template, 'js-env', {
      onBuildLogs: (entry) => logs.push({ level: entry.level, message: entry.message }),
    })
    return { templateId: info.templateId, name: info.name, seconds: (Date.now() - started) / 1000,
             logs }
  }, 300000)
  await step('exists', async () => [await Template.exists('js-env'),
                                    await Template.exists('js-never-built')])
  await step('sandbox', async () => {
    const sb = await Sandbox.create('js-env', { timeoutMs: 60000 })
    try {
      return (await sb.commands.run('cat /opt/js/built.txt')).stdout
    } finally {
      await sb.kill()
    }
  }, 120000)
  await step('refused', async () => Template.build(
    Template().fromImage('registry.invalid/team/tools:1'), 'js-elsewhere'))
  done()
}

main().catch((err) => {
  process.stderr.write(String(err && err.stack) + '\n')
  process.exit(1)
})
