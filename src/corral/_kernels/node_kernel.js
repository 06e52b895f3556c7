// The JavaScript and TypeScript kernel, run by node under python_driver.py (``node -e <this>
// <protocol fd> <javascript|typescript>``): cells come as JSON lines on stdin and run in one
// persistent vm context; each cell's result, error and end go to the protocol pipe (the fd in
// argv[1]) as JSON lines; console output goes to fd 1 and 2, which the driver forwards.
//
// With TypeScript's compiler module (Debian's node-typescript) a cell is first transpiled (the
// types erased, imports made require calls; no type check, as tsx and ts-node's transpile-only
// mode) and then rewritten so cells behave as E2B's and Jupyter's: the cell runs in an async
// function, so a top-level ``await`` works; its top-level declarations (const, let, var,
// function, class) become variables of the context, so the next cell sees them and a cell run
// again may declare them again; its last expression statement is the cell's result. Without
// the module JavaScript runs as a plain vm script (state kept, no top-level await) and
// TypeScript is refused by the driver before it gets here.
"use strict";
const fs = require("fs"), vm = require("vm"), util = require("util"),
  readline = require("readline"), path = require("path");
const proto = Number(process.argv[1]);
const language = process.argv[2] || "javascript";
const say = (m) => fs.writeSync(proto, JSON.stringify(m) + "\n");

function loadTypeScript() {
  // Debian installs node modules under /usr/share/nodejs, which a node of another origin
  // (nodesource's, on a host) does not search.
  for (const where of ["typescript", "/usr/share/nodejs/typescript",
                       "/usr/lib/node_modules/typescript"]) {
    try { return require(where); } catch (err) { /* the next place */ }
  }
  return null;
}
const ts = loadTypeScript();
if (language === "typescript" && ts === null) {
  say({ ev: "fatal", message: "TypeScript's compiler module is not installed in this " +
        "sandbox's template (Debian's node-typescript); the code-interpreter template has it" });
  process.exit(3);
}

const userModule = { exports: {} };
const sandbox = { require, console, process, Buffer, URL, URLSearchParams, TextEncoder,
  TextDecoder, setTimeout, setInterval, clearTimeout, clearInterval, setImmediate,
  clearImmediate, queueMicrotask, structuredClone, fetch: globalThis.fetch,
  AbortController, module: userModule, exports: userModule.exports,
  __filename: path.join(process.cwd(), "cell.js"), __dirname: process.cwd() };
sandbox.globalThis = sandbox;
const context = vm.createContext(sandbox);

class CellSyntaxError extends SyntaxError {}

function transpile(code) {
  const out = ts.transpileModule(code, {
    fileName: language === "typescript" ? "cell.ts" : "cell.js", reportDiagnostics: true,
    compilerOptions: { target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.CommonJS,
                       esModuleInterop: true, allowJs: true, sourceMap: false } });
  const errors = (out.diagnostics || []).filter(
    (d) => d.category === ts.DiagnosticCategory.Error);
  if (errors.length) {
    const d = errors[0];
    let where = "";
    if (d.file && d.start !== undefined) {
      const at = d.file.getLineAndCharacterOfPosition(d.start);
      where = ` (line ${at.line + 1}, column ${at.character + 1})`;
    }
    throw new CellSyntaxError(ts.flattenDiagnosticMessageText(d.messageText, "\n") + where);
  }
  return out.outputText;
}

function boundNames(name, into) {
  if (ts.isIdentifier(name)) into.push(name.text);
  else for (const element of name.elements) {
    if (!ts.isOmittedExpression(element)) boundNames(element.name, into);
  }
}

// The cell as a script: its functions at the top (hoisted, as in a script), its other
// declared names as ``var``s of the context, the rest in an async function returning the last
// expression statement's value.
function rewrite(code) {
  const js = transpile(code);
  const file = ts.createSourceFile("cell.js", js, ts.ScriptTarget.ES2022, true,
                                   ts.ScriptKind.JS);
  const names = [], hoisted = [], body = [];
  const text = (node) => js.slice(node.getStart(file), node.end);
  const statements = file.statements;
  statements.forEach((statement, index) => {
    if (ts.isVariableStatement(statement)) {
      for (const declaration of statement.declarationList.declarations) {
        boundNames(declaration.name, names);
        if (declaration.initializer) {
          body.push(`void (${text(declaration.name)} = ${text(declaration.initializer)});`);
        }
      }
    } else if (ts.isFunctionDeclaration(statement) && statement.name) {
      hoisted.push(text(statement));
    } else if (ts.isClassDeclaration(statement) && statement.name) {
      names.push(statement.name.text);
      body.push(`void (${statement.name.text} = ${text(statement)});`);
    } else if (index === statements.length - 1 && ts.isExpressionStatement(statement)) {
      body.push(`return (${text(statement.expression)});`);
    } else {
      body.push(text(statement));
    }
  });
  const declared = names.length ? `var ${[...new Set(names)].join(", ")};\n` : "";
  return `${hoisted.join("\n")}\n${declared}(async () => {\n${body.join("\n")}\n})()`;
}

function run(code) {
  if (ts === null) return vm.runInContext(code, context, { filename: "cell.js",
                                                           breakOnSigint: true });
  return vm.runInContext(rewrite(code), context, { filename: "cell.js", breakOnSigint: true });
}

// The stack without this kernel's own frames: the user's starts in the cell.
function traceback(err) {
  if (!(err && typeof err === "object" && err.stack)) return String(err);
  if (err instanceof CellSyntaxError) return `SyntaxError: ${err.message}`;
  return String(err.stack).split("\n").filter(
    (line) => !/^\s+at .*(\[eval\]|node:|sigintHandlersWrap)/.test(line)
  ).join("\n");
}

// An interrupt while a cell awaits (vm's breakOnSigint covers only its synchronous part) ends
// the wait; what the cell started goes on in the background, as in node's REPL.
let abort = null;
process.on("SIGINT", () => { if (abort !== null) abort(); });

async function cell(code) {
  try {
    let value = run(code);
    if (value && typeof value.then === "function") {
      value = await Promise.race([value, new Promise((resolve, reject) => {
        abort = () => reject(Object.assign(new Error("interrupted"),
                                           { code: "ERR_SCRIPT_EXECUTION_INTERRUPTED" }));
      })]);
    }
    if (value !== undefined) say({ ev: "result", data: { "text/plain": util.inspect(value) } });
  } catch (err) {
    const isError = err && typeof err === "object";
    let name = isError && err.name ? String(err.name) : "Error";
    if (isError && err.code === "ERR_SCRIPT_EXECUTION_INTERRUPTED") name = "KeyboardInterrupt";
    if (err instanceof CellSyntaxError) name = "SyntaxError";
    say({ ev: "error", name,
          value: isError && "message" in err ? String(err.message) : String(err),
          traceback: traceback(err) });
  } finally {
    abort = null;
  }
  say({ ev: "end" });
}

const queue = [];
let running = false;
async function pump() {
  if (running) return;
  running = true;
  while (queue.length) await cell(queue.shift());
  running = false;
}
readline.createInterface({ input: process.stdin }).on("line", (line) => {
  queue.push(JSON.parse(line).code);
  pump();
}).on("close", () => process.exit(0));
say({ ev: "ready", typescript: ts !== null });
