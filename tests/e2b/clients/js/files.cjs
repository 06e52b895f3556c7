// Scenario 3, files, through the official JS SDK. Usage: node files.cjs
'use strict'
const { Sandbox } = require('e2b')
const { step, done } = require('./_steps.cjs')

async function main() {
  const sb = await step('create', () => Sandbox.create({ timeoutMs: 180000 }))
  await step('id', async () => sb.sandboxId)
  const blob = new Uint8Array(2048).map((_, i) => i % 256)
  await step('write_text', async () => (await sb.files.write('/home/user/hello.txt', 'hello, files\n')).path)
  await step('write_bytes', async () => (await sb.files.write('/home/user/blob.bin', blob.buffer)).path)
  await step('write_multi', async () => (await sb.files.write([
    { path: '/home/user/multi/a.txt', data: 'A' }, { path: '/home/user/multi/b.txt', data: 'B' }])).map((w) => w.path))
  await step('read_text', () => sb.files.read('/home/user/hello.txt'))
  await step('read_bytes', async () => Buffer.from(await sb.files.read('/home/user/blob.bin', { format: 'bytes' })).equals(Buffer.from(blob)))
  await step('read_missing', () => sb.files.read('/home/user/nope.txt'))
  await step('list_depth2', async () => (await sb.files.list('/home/user', { depth: 2 })).map((e) => e.path).sort())
  await step('exists', async () => [await sb.files.exists('/home/user/hello.txt'), await sb.files.exists('/home/user/nope')])
  await step('get_info', async () => { const e = await sb.files.getInfo('/home/user/blob.bin'); return { size: e.size, type: e.type } })
  await step('make_dir', async () => [await sb.files.makeDir('/home/user/d'), await sb.files.makeDir('/home/user/d')])
  await step('rename', async () => (await sb.files.rename('/home/user/hello.txt', '/home/user/renamed.txt')).path)
  await step('remove', async () => { await sb.files.remove('/home/user/renamed.txt'); return sb.files.exists('/home/user/renamed.txt') })
  await step('kill_sandbox', () => sb.kill())
  done()
}
main()
