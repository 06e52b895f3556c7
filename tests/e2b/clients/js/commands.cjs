// Scenario 2, commands, through the official JS SDK. Usage: node commands.cjs
'use strict'
const { Sandbox } = require('e2b')
const { step, done } = require('./_steps.cjs')

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

async function main() {
  const sb = await step('create', () => Sandbox.create({ timeoutMs: 180000 }))
  await step('id', async () => sb.sandboxId)
  const run = async (cmd, opts) => {
    const r = await sb.commands.run(cmd, opts)
    return { stdout: r.stdout, stderr: r.stderr, exit_code: r.exitCode }
  }
  await step('echo', () => run('echo hello e2b'))
  await step('stderr', () => run('echo oops >&2'))
  await step('exit3', () => run('echo partial; exit 3'))
  await step('home', () => run('pwd; echo "$HOME $USER"'))
  await step('cwd', async () => { await run('mkdir -p /home/user/sub'); return run('pwd', { cwd: '/home/user/sub' }) })
  await step('envs', () => run('echo "$FOO"', { envs: { FOO: 'foo' } }))
  await step('callbacks', async () => {
    const out = []
    await sb.commands.run('echo a; echo b', { onStdout: (d) => out.push(d) })
    return out.join('')
  })
  await step('timeout', async () => {
    const start = Date.now()
    try { await sb.commands.run('sleep 7', { timeoutMs: 1000 }) } catch (e) {
      return { error: e.constructor.name, seconds: (Date.now() - start) / 1000 }
    }
    return { error: null }
  })
  await step('background', async () => {
    const h = await sb.commands.run('cat', { background: true, stdin: true, timeoutMs: 0 })
    const listed = (await sb.commands.list()).map((p) => p.pid)
    await sb.commands.sendStdin(h.pid, 'first line\n')
    await sleep(300)
    await h.disconnect()
    const out = []
    const again = await sb.commands.connect(h.pid, { onStdout: (d) => out.push(d) })
    await sb.commands.sendStdin(h.pid, 'seen by the new handle\n')
    await sleep(500)
    const killed = await sb.commands.kill(h.pid)
    let code
    try { code = (await again.wait()).exitCode } catch (e) { code = e.exitCode }
    return { pid: h.pid, listed, kill: killed, exit_code: code, reconnected: out.join(''),
             kill_again: await sb.commands.kill(h.pid) }
  })
  await step('kill_sandbox', () => sb.kill())
  done()
}
main()
