// What every JS client script shares (the twin of ../py/_steps.py): run named async steps,
// print each as one JSON line ({"step", "value"} or {"step", "error", "bases", "message",
// "attrs"}), then {"done": true}. A step failing never stops the next ones; each is bounded.
'use strict'

const STEP_MS = 40000
const ATTRS = ['exitCode', 'stdout', 'stderr', 'error']

// SDK objects (a Sandbox, a handle) are not results: report their class, never their fields
// (they hold access tokens).
function plain(value) {
  if (value === undefined) return null
  if (value && typeof value === 'object' && !Array.isArray(value) &&
      Object.getPrototypeOf(value) !== Object.prototype) {
    return `<${value.constructor ? value.constructor.name : 'object'}>`
  }
  return value
}

function emit(record) {
  process.stdout.write(JSON.stringify(record) + '\n')
}

function bases(err) {
  const out = []
  let proto = Object.getPrototypeOf(err)
  while (proto && proto.constructor && proto.constructor.name !== 'Object') {
    out.push(proto.constructor.name)
    proto = Object.getPrototypeOf(proto)
  }
  return out.slice(1)
}

async function step(name, fn, ms = STEP_MS) {
  let timer
  const started = Date.now()
  const overrun = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`step took longer than ${ms} ms`)), ms)
  })
  try {
    const value = await Promise.race([fn(), overrun])
    emit({ step: name, value: plain(value), ms: Date.now() - started })
    return value
  } catch (err) {
    const attrs = {}
    for (const a of ATTRS) if (err && err[a] !== undefined) attrs[a] = err[a]
    emit({ step: name, ms: Date.now() - started, error: (err && err.constructor && err.constructor.name) || 'Error',
           bases: err ? bases(err) : [], message: String(err && err.message).slice(0, 2000),
           attrs, trace: String(err && err.stack).slice(0, 3000) })
    return undefined
  } finally {
    clearTimeout(timer)
  }
}

function done() {
  emit({ done: true })
  // The SDKs' keep-alive agents would hold the event loop open for a minute.
  process.exit(0)
}

module.exports = { step, done }
