// E2B's JS SDK, unmodified, against `cleanroom serve` (E2B_API_URL, E2B_SANDBOX_URL,
// E2B_API_KEY set by tests/server/test_js.py): create, run, files, kill; prints one JSON line.
import { Sandbox, CommandExitError } from 'e2b'

const dir = process.argv[2]
const sbx = await Sandbox.create('fake')
const run = await sbx.commands.run('echo from-js; echo to-err >&2')
let exitCode = null
try {
  await sbx.commands.run('exit 5')
} catch (e) {
  exitCode = e instanceof CommandExitError ? e.exitCode : String(e)
}
await sbx.files.write(`${dir}/js.txt`, 'written by js')
const read = await sbx.files.read(`${dir}/js.txt`)
const names = (await sbx.files.list(dir)).map((e) => e.name)
const listed = (await Sandbox.list().nextItems()).map((s) => s.sandboxId)
const id = sbx.sandboxId
await sbx.kill()
console.log(JSON.stringify({ id, stdout: run.stdout, stderr: run.stderr, exitCode, read, names, listed }))
