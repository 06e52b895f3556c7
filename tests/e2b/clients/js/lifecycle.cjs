// Scenario 1, lifecycle, through the official JS SDK. Usage: node lifecycle.cjs TAG
'use strict'
const { Sandbox } = require('e2b')
const { step, done } = require('./_steps.cjs')

async function main() {
  const tag = process.argv[2]
  const sb = await step('create', async () => {
    const s = await Sandbox.create({ timeoutMs: 120000, metadata: { suite: tag, role: 'main' },
                                     envs: { GREETING: 'hello from envs' } })
    return s
  })
  const id = sb ? sb.sandboxId : 'sbx-missing'
  await step('id', async () => id)
  await step('sandbox_envs', async () => (await sb.commands.run('echo "$GREETING"')).stdout)
  const info = async () => {
    const i = await Sandbox.getInfo(id)
    return { sandbox_id: i.sandboxId, metadata: i.metadata, state: i.state,
             started_is_date: i.startedAt instanceof Date, cpu_count: i.cpuCount,
             ttl_s: (i.endAt.getTime() - Date.now()) / 1000 }
  }
  await step('get_info', info)
  const other = await step('create_second', () => Sandbox.create({ timeoutMs: 120000,
    metadata: { suite: tag, role: 'other' } }))
  await step('second_id', async () => other.sandboxId)
  const pages = async (metadata, limit) => {
    const p = Sandbox.list({ query: { metadata }, limit })
    const out = []
    while (p.hasNext && out.length < 6) out.push((await p.nextItems()).map((s) => s.sandboxId).sort())
    return out
  }
  await step('list_paged', () => pages({ suite: tag }, 1))
  await step('list_filtered', () => pages({ suite: tag, role: 'main' }, 10))
  await step('set_timeout', async () => { await sb.setTimeout(300000); return (await info()).ttl_s })
  await step('connect_running', async () => (await (await Sandbox.connect(id)).commands.run('echo connected')).stdout)
  await step('pause', () => (sb.pause ? sb.pause() : sb.betaPause()))
  await step('paused_state', async () => (await info()).state)
  await step('connect_paused', async () => (await (await Sandbox.connect(id)).commands.run('echo resumed')).stdout)
  await step('kill', () => sb.kill())
  await step('kill_again', () => Sandbox.kill(id))
  await step('killed_get_info', () => Sandbox.getInfo(id))
  await step('killed_rpc', () => sb.commands.run('true'))
  await step('bad_key_create', () => Sandbox.create({ apiKey: 'e2b_' + '0'.repeat(48) }))
  await step('kill_second', () => other.kill())
  done()
}
main()
