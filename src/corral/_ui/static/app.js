// Corral's dashboard: one page, no build step, no dependency. Every value from the service
// (sandbox output above all: a prompt-injected agent writes it) reaches the page through
// textContent, never as HTML. Requests carry X-Corral-UI: 1, which the service requires of
// every call signed in with the session cookie (no other site can add it).
"use strict";

const UI = { "X-Corral-UI": "1" };
const TIMELINE_TAIL = 1000;
const main = document.getElementById("main");
let leave = new AbortController();  // aborts the current page's streams on navigation

class Unauthorized extends Error {}

async function api(path, options = {}) {
  const headers = { ...UI, ...(options.headers || {}) };
  if (options.json !== undefined) {
    headers["content-type"] = "application/json";
    options = { ...options, body: JSON.stringify(options.json) };
  }
  const answer = await fetch(path, { credentials: "same-origin", ...options, headers });
  if (answer.status === 401) throw new Unauthorized((await answer.json()).message);
  if (!answer.ok) {
    let message = `${answer.status} ${answer.statusText}`;
    try { message = (await answer.json()).message || message; } catch (_) { /* not JSON */ }
    const error = new Error(message);
    error.status = answer.status;
    throw error;
  }
  return answer;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "text") node.textContent = value;
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

async function* lineBatches(answer) {
  // The lines each read brought, together: a long trail's page is drawn in one go.
  for await (const batch of rawLineBatches(answer)) {
    const full = batch.filter((line) => line.trim());
    if (full.length) yield full;
  }
}

async function* serverEvents(answer) {
  // The stream's first line, a comment, comes once the service listens for changes: said
  // as {subscribed: true}, so a page reads its list again then (what changed before is in it).
  let data = [];
  let first = true;
  for await (const line of linesKeepingBlanks(answer)) {
    if (first && line.startsWith(":")) { first = false; yield { subscribed: true }; continue; }
    if (line === "") {
      if (data.length) yield JSON.parse(data.join("\n"));
      data = [];
    } else if (line.startsWith("data:")) data.push(line.slice(5).trim());
  }
}

async function* linesKeepingBlanks(answer) {
  for await (const batch of rawLineBatches(answer)) yield* batch;
}

async function* rawLineBatches(answer) {
  const reader = answer.body.getReader();
  const decoder = new TextDecoder();
  let pending = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    pending += decoder.decode(value, { stream: true });
    const parts = pending.split("\n");
    pending = parts.pop();
    if (parts.length) yield parts;
  }
}

const ago = (ts) => {
  const s = Math.max(0, Date.now() / 1000 - ts);
  if (s < 60) return `${Math.round(s)} s`;
  if (s < 3600) return `${Math.round(s / 60)} min`;
  return `${(s / 3600).toFixed(1)} h`;
};
const left = (ts) => ago(Date.now() / 1000 - (ts - Date.now() / 1000));
const clock = (ts) => new Date(ts * 1000).toLocaleTimeString([], { hour12: false });
const pill = (text, kind = text) => el("span", { class: `pill ${kind}`, text });

function page(title, ...children) {
  main.replaceChildren(el("h1", { text: title }), ...children);
  document.title = `${title} · Corral`;
  const hash = location.hash || "#/sandboxes";
  for (const link of document.querySelectorAll("nav a[data-nav]")) {
    if (hash.startsWith(`#/${link.dataset.nav}`)) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
}

// -- sign-in ---------------------------------------------------------------------------------

function signIn(reason) {
  const error = el("p", { class: "error", role: "alert", text: reason || "" });
  const key = el("input", { type: "password", id: "key", name: "key", autocomplete: "off",
                            required: true, placeholder: "ck_…" });
  const form = el("form", { class: "panel signin", onsubmit: async (event) => {
    event.preventDefault();
    error.textContent = "";
    try {
      await api("/ui/session", { method: "POST", json: { key: key.value } });
      key.value = "";
      await who();
      route();
    } catch (failure) { error.textContent = failure.message; }
  } },
  el("h1", { text: "Sign in to Corral" }),
  el("label", { for: "key", text: "API key" }), key,
  el("p", { class: "muted", text: "A key from `corral keys create TENANT`. It is sent once; the " +
            "session is a cookie this page cannot read." }),
  el("div", { class: "row" }, el("button", { class: "primary", type: "submit", text: "Sign in" })),
  error);
  main.replaceChildren(form);
  document.title = "Sign in · Corral";
  key.focus();
}

async function who() {
  const box = document.getElementById("who");
  try {
    const me = await (await api("/ui/api/me")).json();
    for (const link of document.querySelectorAll("nav a[data-operator]")) link.hidden = !me.operator;
    box.replaceChildren(el("span", { text: me.operator ? "operator" : `tenant ${me.tenant}` }),
      el("button", { type: "button", text: "Sign out", onclick: async () => {
        await fetch("/ui/session", { method: "DELETE", headers: UI });
        box.replaceChildren();
        signIn();
      } }));
    return me;
  } catch (failure) {
    box.replaceChildren();
    throw failure;
  }
}

// -- the sandboxes ---------------------------------------------------------------------------

async function sandboxesPage(signal) {
  const state = { q: "", offset: 0, limit: 50 };
  const body = el("tbody");
  const count = el("span", { class: "muted" });
  const live = el("span", { class: "muted", "aria-live": "polite" });
  const search = el("input", { type: "search", placeholder: "Filter by id, template, state, label…",
                               "aria-label": "Filter sandboxes" });
  const prev = el("button", { type: "button", text: "Previous" });
  const next = el("button", { type: "button", text: "Next" });
  page("Sandboxes",
    el("div", { class: "row" }, search, live),
    el("table", { "aria-label": "Sandboxes" },
      el("thead", {}, el("tr", {}, ["Sandbox", "State", "Tier", "Isolation", "Template", "Age",
                                    "Expires in", "CPU", "Memory", "Labels"].map((h) => el("th", { scope: "col", text: h })))),
      body),
    el("div", { class: "pager" }, count, prev, next));

  async function load() {
    const query = new URLSearchParams({ offset: state.offset, limit: state.limit, q: state.q });
    const data = await (await api(`/ui/api/sandboxes?${query}`, { signal })).json();
    // The live list redraws the rows: a keyboard user's focus on a row's link moves to the
    // same link redrawn, or a key pressed next would go nowhere.
    const focused = body.contains(document.activeElement) ? document.activeElement.getAttribute("href") : null;
    body.replaceChildren(...data.items.map((info) => el("tr", { "data-id": info.id },
      el("td", { class: "id" }, el("a", { href: `#/sandboxes/${info.id}`, text: info.id })),
      el("td", {}, pill(info.sleeping_since ? `${info.state} ${ago(info.sleeping_since)}` : info.state, info.state)),
      el("td", { text: info.resources }),
      el("td", { text: info.isolation }),
      el("td", { text: info.image || info.template }),
      el("td", { text: ago(info.created_at) }),
      el("td", { text: info.expires_at ? left(info.expires_at) : "—" }),
      el("td", { text: data.usage[info.id] ? `${data.usage[info.id].cpu_s.toFixed(2)} s` : "—" }),
      el("td", { text: data.usage[info.id] ? `${(data.usage[info.id].memory_bytes / 1048576).toFixed(1)} MiB` : "—" }),
      el("td", {}, Object.entries(info.labels).map(([k, v]) => el("span", { class: "label",
                                                                  text: `${k}=${v}` }))))));
    if (!data.items.length) {
      body.replaceChildren(el("tr", {}, el("td", { colspan: 10, class: "muted",
                                                 text: state.q ? "No sandbox matches." : "No sandboxes yet." })));
    }
    if (focused) body.querySelector(`a[href="${CSS.escape(focused)}"]`)?.focus();
    const last = Math.min(data.total, state.offset + data.items.length);
    count.textContent = data.total ? `${state.offset + 1}–${last} of ${data.total}` : "";
    prev.disabled = state.offset === 0;
    next.disabled = last >= data.total;
  }

  let timer = null;
  const soon = () => { clearTimeout(timer); timer = setTimeout(() => load().catch(() => {}), 100); };
  search.addEventListener("input", () => { state.q = search.value; state.offset = 0; soon(); });
  prev.addEventListener("click", () => { state.offset = Math.max(0, state.offset - state.limit); load(); });
  next.addEventListener("click", () => { state.offset += state.limit; load(); });
  await load();
  (async () => {  // the live list: one event per change, then this page of it read again
    const stream = await api("/ui/api/stream", { signal });
    live.replaceChildren(el("span", { class: "live" }), "live");
    for await (const change of serverEvents(stream)) { void change; soon(); }  // subscribed, or a change
  })().catch(() => { live.textContent = ""; });
}

// -- one sandbox -----------------------------------------------------------------------------

async function sandboxPage(id, signal) {
  const facts = el("div", { class: "facts panel" });
  const timeline = el("ol", { class: "timeline", "aria-label": "Timeline", "aria-live": "polite" });
  const status = el("p", { class: "error", role: "alert" });
  const notice = el("p", { class: "muted", role: "status" });
  const files = el("div", { class: "panel", "aria-label": "Files" });
  const family = el("div", { class: "panel", "aria-label": "Family" });
  const terminal = el("div", { class: "terminal", hidden: true });
  const command = el("input", { type: "text", id: "command", placeholder: "a shell command",
                                "aria-label": "Command to run" });
  const act = async (what, fn) => {
    status.textContent = ""; notice.textContent = "";
    try { const said = await fn(); if (said) notice.textContent = said; }
    catch (failure) { if (!signal.aborted) status.textContent = `${what}: ${failure.message}`; }
  };
  // What this page runs shows beside the button, streamed (newest first); the timeline shows
  // those commands' start and end but not their output again (`mine`: by the run's token in
  // its context). After a reload the timeline shows all of it, from the audit trail.
  const runs = el("ol", { class: "runs", "aria-label": "Runs from this page" });
  const mine = new Map();
  const run = el("form", { class: "row", onsubmit: (event) => {
    event.preventDefault();
    if (!command.value.trim()) return;
    runCommand(id, command.value, runs, mine, signal);
  } }, command, el("button", { class: "primary", type: "submit", text: "Run" }));
  const ports = el("div", { class: "panel", "aria-label": "Exposed ports" });
  const processes = el("div", { class: "panel", "aria-label": "Background processes" });
  const button = (text, fn, cls) => el("button", { type: "button", text, class: cls, onclick: fn });
  const actions = el("div", { class: "row", role: "toolbar", "aria-label": "Actions" },
    button("Terminal", () => act("Terminal", () => openTerminal(id, terminal, signal))),
    button("Snapshot", () => act("Snapshot", async () => {
      const snap = await (await api(`/v1/sandboxes/${id}/snapshots`, { method: "POST", json: {} })).json();
      await showFamily(id, family, signal, act);
      return `Snapshot ${snap.id} taken.`;
    })),
    button("Fork", () => act("Fork", async () => {
      const [child] = await (await api(`/v1/sandboxes/${id}/fork`, { method: "POST", json: { count: 1 } })).json();
      await showFamily(id, family, signal, act);
      return `Forked into ${child.id}.`;
    })),
    button("Pause", () => act("Pause", async () => { await api(`/v1/sandboxes/${id}/pause`, { method: "POST" }); return "Paused."; })),
    button("Hibernate", () => act("Hibernate", async () => { await api(`/v1/sandboxes/${id}/hibernate`, { method: "POST" }); return "Hibernated: nothing of it is left in the kernel; Resume wakes it."; })),
    button("Resume", () => act("Resume", async () => { await api(`/v1/sandboxes/${id}/resume`, { method: "POST" }); return "Resumed."; })),
    button("Extend 10 min", () => act("Extend", async () => {
      await api(`/v1/sandboxes/${id}/timeout`, { method: "POST", json: { timeout: 600 } });
      return "It now ends 10 minutes from now.";
    })),
    button("Destroy", () => act("Destroy", async () => {
      if (!confirm(`Destroy ${id}? Its processes stop and its workspace is deleted.`)) return "";
      await api(`/v1/sandboxes/${id}`, { method: "DELETE" });
      location.hash = "#/sandboxes";
      return "";
    }), "danger"));
  page(id, facts, el("h2", { text: "Act" }), run, runs, actions, status, notice, terminal,
       el("h2", { text: "Ports" }), ports, el("h2", { text: "Background processes" }), processes,
       el("h2", { text: "Files" }), files, el("h2", { text: "Snapshots and forks" }), family,
       el("h2", { text: "Timeline" }), timeline);

  // Asked at once, beside the sandbox's facts.
  const trail = api(`/v1/sandboxes/${id}/audit?follow=true&tail=${TIMELINE_TAIL}`, { signal });
  trail.catch(() => {});
  try {
    const info = await (await api(`/v1/sandboxes/${id}`, { signal })).json();
    facts.replaceChildren(...[["State", pill(info.state)],
      ...(info.sleeping_since ? [["Asleep since", `${ago(info.sleeping_since)} ago`]] : []),
      ["Tier", info.resources],
      ["Isolation", info.isolation], ["Template", info.image || info.template],
      ["Created", `${ago(info.created_at)} ago`], ["Ends in", left(info.expires_at)],
      ["Network", networkText(info.network)],
      ["Labels", Object.entries(info.labels).map(([k, v]) => `${k}=${v}`).join(" ") || "—"]]
      .map(([name, value]) => el("div", {}, el("span", { text: name }), value)));
    showFiles(id, "/workspace", files, signal).catch(() => {});
  } catch (failure) {
    if (failure instanceof Unauthorized) throw failure;
    facts.replaceChildren(el("p", { class: "muted", text: "This sandbox is gone; its audit trail remains." }));
    run.remove(); runs.remove(); actions.remove();
    for (const box of [ports, processes, files]) { box.previousSibling.remove(); box.remove(); }
  }
  // Ports and processes: read again when the trail says they changed (a command or process
  // started or ended, a port exposed or not), and every 30 s while the tab is seen (fresh
  // signed links, and what no event announced).
  const live = ports.isConnected ? liveLists(id, ports, processes, signal, act) : { changed() {} };
  showFamily(id, family, signal, facts.isConnected ? act : null).catch(() => { family.textContent = ""; });
  // The trail's last events, then what comes: a long trail (an agent's day) renders at once.
  const commands = new Map();
  const answer = await trail;
  let first = true;
  for await (const batch of lineBatches(answer)) {
    const drawn = document.createDocumentFragment();
    for (const line of batch) {
      const event = JSON.parse(line);
      if (first && event.seq > 1) {
        timeline.before(el("p", { class: "muted", text: `Events #1–#${event.seq - 1} are not shown ` +
          `(the last ${TIMELINE_TAIL} are); the whole trail: \`corral replay ${id}\` or GET /v1/sandboxes/${id}/audit.` }));
      }
      first = false;
      drawn.append(...render(event, commands, mine));
      live.changed(event.type);
    }
    timeline.append(drawn);
  }
}

// -- the Run button's output ------------------------------------------------------------------

const OUTPUT_KEEP = 256 * 1024;  // characters of one run's output kept on the page (the last ones)
const RUNS_KEPT = 5;

function runCommand(id, cmd, runs, mine, signal) {
  const token = `run_${crypto.getRandomValues(new Uint32Array(2)).join("")}`;
  const shown = runView(id, cmd, signal);
  runs.prepend(shown.node);
  mine.set(token, shown);
  while (runs.children.length > RUNS_KEPT) {
    const dropped = runs.lastElementChild;
    for (const [key, view] of mine) if (view.node === dropped && view.over) mine.delete(key);
    dropped.remove();
  }
  (async () => {
    const answer = await api(`/v1/sandboxes/${id}/commands`, { method: "POST", signal,
      json: { cmd, stream: true, context: { source: "dashboard", run: token } } });
    for await (const batch of lineBatches(answer)) {
      for (const line of batch) {
        const event = JSON.parse(line);
        if (event.type === "stdout" || event.type === "stderr") shown.write(event.type, event.data);
        else if (event.type === "truncated") shown.write(event.stream, event.data || "");
        else if (event.type === "result") shown.end(event);
        else if (event.type === "error") shown.fail(`${event.message} (${event.error})`);
      }
      shown.flush();
    }
    if (!shown.over) shown.fail("the stream broke off before the command's end (the timeline " +
                                "shows it from the audit trail)");
  })().catch((failure) => {
    if (signal.aborted) return;
    shown.fail(failure.status ? `refused: ${failure.message}` : failure.message);
  });
}

function outputBox() {
  // Tenant-controlled bytes: text nodes only, never markup; only the last OUTPUT_KEEP
  // characters stay on the page, so a flood cannot freeze the tab.
  const out = el("pre", { class: "out", "aria-label": "output" });
  const cut = el("p", { class: "muted", hidden: true });
  let kept = 0;
  let dropped = 0;
  return {
    out, cut,
    write(stream, text) {
      if (!text) return;
      const last = out.lastElementChild;
      const stick = out.scrollTop + out.clientHeight >= out.scrollHeight - 4;
      if (last && last.dataset.stream === stream) last.firstChild.appendData(text);
      else out.append(el("span", { class: stream === "stderr" ? "stderr" : "stdout", "data-stream": stream, text }));
      kept += text.length;
      while (kept > OUTPUT_KEEP && out.firstElementChild) {
        const first = out.firstElementChild;
        const size = first.firstChild.length;
        const gone = Math.min(size, kept - OUTPUT_KEEP);
        if (gone === size) first.remove();
        else first.firstChild.deleteData(0, gone);
        kept -= gone;
        dropped += gone;
      }
      if (stick) out.scrollTop = out.scrollHeight;
    },
    flush() {
      if (!dropped) return;
      cut.hidden = false;
      cut.textContent = `The first ${dropped.toLocaleString()} characters are not shown here (the last ` +
        `${OUTPUT_KEEP / 1024} KiB are); the audit trail keeps what the service captured.`;
    },
  };
}

function runView(id, cmd, signal) {
  const box = outputBox();
  const result = el("span", { class: "muted", "aria-live": "polite", text: " running…" });
  const tools = el("span");
  const node = el("li", { class: "command run" }, el("code", { text: cmd }), result, tools, box.cut, box.out);
  const view = {
    node, over: false,
    write: box.write,
    flush: box.flush,
    started(commandId) {  // the trail named the command: it can be killed by that id
      if (view.over) return;
      tools.replaceChildren(" ", el("button", { type: "button", class: "small", text: "Kill",
        "aria-label": "Kill this command", onclick: async (event) => {
          event.target.disabled = true;
          try { await api(`/v1/sandboxes/${id}/commands/${commandId}/kill`, { method: "POST", signal }); }
          catch (failure) { if (!signal.aborted) view.fail(`kill: ${failure.message}`, false); }
        } }));
    },
    end(r) {
      view.over = true;
      tools.replaceChildren();
      for (const stream of ["stdout", "stderr"]) {  // what the events did not carry (a cut notice)
        if (r[`${stream}_tail`]) view.write(stream, r[`${stream}_tail`]);
      }
      view.flush();
      const seconds = typeof r.duration_s === "number" ? ` · ${r.duration_s.toFixed(3)} s` : "";
      const why = r.timed_out ? " · timed out" : r.usage && r.usage.oom_killed ? " · out of memory"
        : r.exit_code > 128 ? ` · killed (signal ${r.exit_code - 128})` : "";
      result.replaceChildren(" ", el("span", { class: "exit", "data-exit-code": r.exit_code,
                                               text: `exit ${r.exit_code}` }), `${seconds}${why}`);
      if (r.exit_code !== 0 || r.timed_out) node.classList.add("failed");
    },
    fail(message, final = true) {
      if (final) { view.over = true; tools.replaceChildren(); }
      node.classList.add("failed");
      result.replaceChildren(" ", el("span", { class: "error", role: "alert", text: message }));
    },
  };
  return view;
}

// -- ports and background processes ------------------------------------------------------------

const LISTS_EVERY_MS = 30_000;

function liveLists(id, ports, processes, signal, act) {
  let timer = null;
  let waiting = Promise.resolve();
  const load = () => {
    waiting = waiting.then(() => Promise.all([
      showPorts(id, ports, signal).catch((f) => { if (!signal.aborted) ports.textContent = f.message; }),
      showProcesses(id, processes, signal, act, soon).catch((f) => { if (!signal.aborted) processes.textContent = f.message; }),
    ]));
    return waiting;
  };
  function soon() {
    clearTimeout(timer);
    if (!signal.aborted) timer = setTimeout(load, 200);
  }
  load();
  const every = setInterval(() => { if (!document.hidden) soon(); }, LISTS_EVERY_MS);
  signal.addEventListener("abort", () => { clearTimeout(timer); clearInterval(every); });
  return {
    changed(type) {
      if (["port.exposed", "port.unexposed", "command.started", "command.finished"].includes(type)) soon();
    },
  };
}

function previewLink(port) {
  // A port's host URL is an origin of its own, never the dashboard's: opened in a new tab,
  // with no opener and no referrer. A private port's link carries its signature (it sets the
  // port's cookie there and drops it from the address). Without a host URL, the path URL: the
  // service serves its pages in an opaque origin (docs/ports-and-volumes.md, Origins).
  let href = port.host_url;
  if (href && !port.public && port.signed_url) href += new URL(port.signed_url).search;
  href = href || port.signed_url || port.url;
  if (!href) return el("span", { class: "muted", text: "no URL: the service's address is not known here" });
  const url = new URL(href, location.href);
  if (url.protocol !== "http:" && url.protocol !== "https:") return el("span", { class: "muted", text: "—" });
  return el("a", { href: url.href, target: "_blank", rel: "noopener noreferrer",
                   text: `${url.origin}${url.pathname}` });
}

async function showPorts(id, box, signal) {
  const ports = await (await api(`/v1/sandboxes/${id}/ports`, { signal })).json();
  if (!ports.length) {
    box.replaceChildren(el("p", { class: "muted", text: "No exposed port. `corral ports expose " +
      `${id} PORT\` or POST /v1/sandboxes/${id}/ports/PORT serves one.` }));
    return;
  }
  box.replaceChildren(el("ul", { class: "files" }, ports.sort((a, b) => a.port - b.port).map((p) =>
    el("li", { "data-port": p.port }, el("code", { text: String(p.port) }), " ",
       pill(p.public ? "public" : "private", p.public ? "warn" : "ok"), " ", previewLink(p)))));
}

async function showProcesses(id, box, signal, act, again) {
  const procs = await (await api(`/v1/sandboxes/${id}/processes`, { signal })).json();
  if (!procs.length) {
    box.replaceChildren(el("p", { class: "muted", text: "No background process." }));
    return;
  }
  // Redrawn under a keyboard user's focus: it stays on the same process's button.
  const focused = box.contains(document.activeElement) ? document.activeElement.dataset.process : null;
  procs.sort((a, b) => b.started_at - a.started_at);
  box.replaceChildren(el("ul", { class: "files" }, procs.map((p) => el("li", { "data-process": p.id },
    el("code", { text: p.argv.join(" ") }), " ", pill(p.state === "exited" ? `exited ${p.exit_code ?? "?"}` : p.state,
      p.state === "exited" ? (p.exit_code === 0 ? "ok" : "bad") : "running"),
    el("span", { class: "muted", text: ` ${p.id} · started ${ago(p.started_at)} ago${p.error ? ` · ${p.error}` : ""}` }),
    p.state === "exited" ? null : el("button", { type: "button", class: "small", text: "Kill",
      "aria-label": `Kill ${p.id}`, "data-process": p.id, onclick: (event) => {
        event.target.disabled = true;
        act("Kill", async () => {
          await api(`/v1/sandboxes/${id}/processes/${p.id}/kill`, { method: "POST", signal });
          again();
          return `Killed ${p.id}.`;
        });
      } })))));
  if (focused) box.querySelector(`button[data-process="${CSS.escape(focused)}"]`)?.focus();
}

async function showFiles(id, path, box, signal) {
  const entries = await (await api(`/v1/sandboxes/${id}/files?path=${encodeURIComponent(path)}`, { signal })).json();
  const up = path === "/workspace" ? null : path.replace(/\/[^/]+$/, "") || "/workspace";
  box.replaceChildren(el("div", { class: "muted" }, el("code", { text: path })),
    el("ul", { class: "files" },
      up ? el("li", {}, el("a", { href: "#", text: "..", onclick: (e) => { e.preventDefault(); showFiles(id, up, box, signal); } })) : null,
      entries.sort((a, b) => (a.type !== "dir") - (b.type !== "dir") || a.name.localeCompare(b.name))
        .map((entry) => el("li", {}, entry.type === "dir"
          ? el("a", { href: "#", text: `${entry.name}/`, onclick: (e) => { e.preventDefault(); showFiles(id, entry.path, box, signal); } })
          : el("a", { href: "#", text: entry.name, "data-path": entry.path, onclick: (e) => { e.preventDefault(); download(id, entry); } }),
          el("span", { class: "muted", text: ` ${entry.type === "dir" ? "" : `${entry.size} B`}` })))));
}

async function download(id, entry) {
  // Fetched with the session's header, then handed to the browser as a file of its own.
  const answer = await api(`/v1/sandboxes/${id}/files/content?path=${encodeURIComponent(entry.path)}`);
  const url = URL.createObjectURL(await answer.blob());
  const link = el("a", { href: url, download: entry.name });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

async function showFamily(id, box, signal, act) {
  const tree = await (await api(`/ui/api/sandboxes/${id}/family`, { signal })).json();
  const children = new Map();
  for (const node of tree.nodes) {
    if (!children.has(node.parent)) children.set(node.parent, []);
    children.get(node.parent).push(node);
  }
  const branch = (parent) => {
    const kids = children.get(parent) || [];
    if (!kids.length) return null;
    return el("ul", { class: "tree" }, kids.map((node) => el("li", { "data-node": node.id },
      node.via === "created" || node.via === "restored"
        ? el("span", {}, pill(node.via === "created" ? "snapshot" : "restored", "warn"), " ",
             el("code", { text: node.id }), node.name ? ` ${node.name}` : "",
             act && node.via === "created" && node.parent === id ? el("button", {
               type: "button", class: "small", text: "Restore", "aria-label": `Restore ${node.id}`,
               onclick: () => act("Restore", async () => {
                 if (!confirm(`Put ${id}'s workspace back as it was in ${node.id}?`)) return "";
                 await api(`/v1/sandboxes/${id}/restore`, { method: "POST", json: { snapshot: node.id } });
                 await showFamily(id, box, signal, act);
                 return `Restored to ${node.id}.`;
               }) }) : null)
        : el("span", {}, node.via === "root" ? "" : pill(node.via === "started" ? "started from it" : node.via), " ",
             node.id === id ? el("strong", { text: node.id })
               : el("a", { href: `#/sandboxes/${node.id}`, text: node.id }), " ", pill(node.state)),
      node.via === "restored" ? null : branch(node.id))));
  };
  box.replaceChildren(branch(null) || el("p", { class: "muted", text: "No snapshots or forks." }));
}

let xtermLoaded = null;
function loadXterm() {
  xtermLoaded = xtermLoaded || new Promise((resolve, reject) => {
    document.head.append(el("link", { rel: "stylesheet", href: "/ui/static/vendor/xterm/xterm.css" }));
    const core = el("script", { src: "/ui/static/vendor/xterm/xterm.js" });
    core.onload = () => {
      const fit = el("script", { src: "/ui/static/vendor/xterm/addon-fit.js" });
      fit.onload = resolve; fit.onerror = reject;
      document.head.append(fit);
    };
    core.onerror = reject;
    document.head.append(core);
  });
  return xtermLoaded;
}

async function openTerminal(id, box, signal) {
  await loadXterm();
  box.hidden = false;
  box.replaceChildren();
  const term = new window.Terminal({ fontFamily: getComputedStyle(document.body).getPropertyValue("--mono"),
                                     fontSize: 13, cursorBlink: true, convertEol: false });
  const fit = new window.FitAddon.FitAddon();
  term.loadAddon(fit);
  term.open(box);
  fit.fit();
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  // The session cookie goes with the handshake; the service checks this page's Origin.
  const ws = new WebSocket(`${scheme}://${location.host}/v1/sandboxes/${id}/pty?rows=${term.rows}&cols=${term.cols}`);
  ws.binaryType = "arraybuffer";
  ws.onmessage = (message) => {
    if (typeof message.data === "string") {
      const end = JSON.parse(message.data);
      term.write(`\r\n[${end.type === "exit" ? `exited ${end.exit_code}` : end.message}]\r\n`);
    } else term.write(new Uint8Array(message.data));
  };
  ws.onclose = () => term.options.disableStdin = true;
  term.onData((data) => ws.readyState === 1 && ws.send(JSON.stringify({ type: "input", data })));
  term.onResize(({ rows, cols }) => ws.readyState === 1 && ws.send(JSON.stringify({ type: "resize", rows, cols })));
  signal.addEventListener("abort", () => { ws.close(); term.dispose(); });
  term.focus();
  return "Terminal open: a login shell in the sandbox; closing the page ends it.";
}

// -- egress across sandboxes ------------------------------------------------------------------

async function egressPage(signal) {
  const body = el("tbody");
  page("Egress", el("p", { class: "muted", text: "Every egress decision of your live sandboxes, grouped " +
    "by host, rule and verdict, refusals first: a prompt-injected agent trying to send data out shows here." }),
    el("table", { "aria-label": "Egress decisions" },
      el("thead", {}, el("tr", {}, ["Host", "Verdict", "Rule", "Count", "Last", "Sandboxes"]
        .map((h) => el("th", { scope: "col", text: h })))), body));
  const data = await (await api("/ui/api/egress", { signal })).json();
  body.replaceChildren(...data.groups.map((g) => el("tr", {},
    el("td", {}, el("code", { text: g.host })),
    el("td", {}, pill(g.verdict, g.verdict === "allowed" ? "ok" : "bad")),
    el("td", { text: g.rule }), el("td", { text: g.count }), el("td", { text: `${ago(g.last)} ago` }),
    el("td", {}, g.sandboxes.map((sid) => el("a", { href: `#/sandboxes/${sid}`, class: "label", text: sid }))))));
  if (!data.groups.length) body.replaceChildren(el("tr", {}, el("td", { colspan: 6, class: "muted", text: "No egress yet." })));
}

function networkText(network) {
  if (!network || network.mode === "none" || !network.mode) return "none";
  const allow = (network.allow || []).join(", ");
  return allow ? `${network.mode}: ${allow}` : network.mode;
}

function summary(data, keys) {
  return keys.filter((k) => data[k] !== undefined && data[k] !== null)
    .map((k) => `${k} ${typeof data[k] === "object" ? JSON.stringify(data[k]) : data[k]}`).join(" · ");
}

function render(event, commands, mine = new Map()) {
  const d = event.data || {};
  const item = (kind, cls, ...rest) => el("li", { class: cls, "data-type": event.type },
    el("span", { class: "when", text: clock(event.ts) }), el("span", { class: "kind", text: kind }), ...rest);
  switch (event.type) {
    case "command.started": {
      const ours = mine.get(d.context && d.context.run);  // run from this page: output beside Run
      const box = ours ? null : outputBox();
      const result = el("span", { class: "muted", text: " running…" });
      const context = d.context ? el("div", { class: "muted", text: `context ${JSON.stringify(d.context)}` }) : null;
      const node = item("command", "command", el("code", { text: (d.argv || []).join(" ") }), result, context,
        box ? [box.cut, box.out] : el("div", { class: "muted", text: "Output: beside the Run button, above." }));
      commands.set(event.command, { box, result, node });
      if (ours) ours.started(event.command);
      return [node];
    }
    case "command.output": {
      const known = commands.get(event.command);
      if (!known || !known.box) return [];
      known.box.write(d.stream === "stderr" ? "stderr" : "stdout", d.text);
      known.box.flush();
      return [];
    }
    case "command.finished": {
      const known = commands.get(event.command);
      if (!known) return [];
      const seconds = typeof d.duration_s === "number" ? d.duration_s.toFixed(3) : "?";
      const usage = typeof d.cpu_s === "number"
        ? ` · cpu ${d.cpu_s.toFixed(3)} s · peak ${(d.peak_memory_bytes / 1048576).toFixed(1)} MiB` : "";
      known.result.textContent = ` exit ${d.exit_code ?? "—"} · ${seconds} s${usage}` +
        (d.timed_out ? " · timed out" : "") + (d.oom_killed ? " · out of memory" : "");
      if (d.exit_code !== 0) known.node.classList.add("failed");
      return [];
    }
    case "egress.decision": {
      const refused = d.verdict && !["allow", "allowed"].includes(d.verdict);
      return [item("egress", refused ? "refused" : "", el("code", { text: `${d.host ?? ""}${d.port ? `:${d.port}` : ""}` }),
        " ", pill(d.verdict || "?", refused ? "bad" : "ok"), " ",
        el("span", { class: "muted", text: summary(d, ["rule", "reason", "method", "status"]) }))];
    }
    case "egress.summary":
    case "port.summary": {
      // A flood, aggregated (docs/audit.md): the interval's count past the few written in full.
      const sample = d.sample || {};
      const what = event.type === "egress.summary"
        ? `${sample.verdict || "?"} · rule ${sample.rule || "?"}` : `port ${sample.port ?? "?"}`;
      const seen = Object.entries(d.distinct || {}).map(([k, v]) => `${k} ${v.join(", ")}`).join(" · ");
      return [item(event.type, event.type === "egress.summary" ? "refused" : "",
        el("strong", { text: `${d.count ?? "?"} more` }), " ",
        el("span", { class: "muted", text: `${what} in ${d.window_s ?? "?"} s${seen ? ` · ${seen}` : ""}` }))];
    }
    default: {
      const [group] = event.type.split(".");
      const cls = event.type === "file.refused" ? "refused" : group === "file" ? "file" : "";
      return [item(event.type, cls, el("span", { class: "muted", text: summary(d,
        ["path", "sha256", "bytes", "template", "resources", "isolation", "snapshot", "name",
         "reason", "error", "port"]) }))];
    }
  }
}

// -- templates and images ----------------------------------------------------------------------

async function templatesPage(signal) {
  const body = el("tbody");
  page("Templates and images", el("p", { class: "muted", text: "What sandboxes can start from: " +
    "`base` (the host's system, read-only), templates built with `corral templates build`, and images " +
    "pulled from an allowed registry. Greyed out: beyond your ceiling." }),
    el("table", { "aria-label": "Templates" },
      el("thead", {}, el("tr", {}, ["Name", "Version", "Source", "Size", "Packages", "Built", "Tags"]
        .map((h) => el("th", { scope: "col", text: h })))), body));
  const builds = await (await api("/ui/api/templates", { signal })).json();
  const size = (bytes) => bytes > 1e9 ? `${(bytes / 1e9).toFixed(1)} GB` : `${Math.round(bytes / 1e6)} MB`;
  body.replaceChildren(el("tr", {}, el("td", {}, el("code", { text: "base" })), el("td", { text: "host" }),
      el("td", { text: "the host's /usr, read-only" }), el("td", { text: "—" }), el("td", { text: "—" }),
      el("td", { text: "—" }), el("td", {})),
    ...builds.map((b) => el("tr", { class: b.allowed ? "" : "muted", "data-template": b.name },
      el("td", {}, el("code", { text: b.name }), b.current ? " " : "", b.current ? pill("current", "ok") : ""),
      el("td", {}, el("code", { text: String(b.version).slice(0, 19) })),
      el("td", { text: b.image ? b.image.reference : (b.packages.join(" ") || "Debian") }),
      el("td", { text: size(b.size_bytes) }), el("td", { text: b.installed_packages }),
      el("td", { text: `${ago(b.built_at)} ago` }),
      el("td", {}, b.tags.map((t) => el("span", { class: "label", text: t }))))));
}

// -- metrics at a glance -----------------------------------------------------------------------

async function metricsPage(signal) {
  const grid = el("div", { class: "cards" });
  page("Metrics", el("p", { class: "muted", text: "The service's Prometheus counters (/metrics), summed " +
    "over their labels, read every 5 s while this page is open; each chart is the last 5 minutes." }), grid);
  const history = new Map();
  const cards = new Map();
  for (;;) {
    const text = await (await api("/metrics", { signal })).text();
    const now = Date.now() / 1000;
    for (const [name, value] of parseMetrics(text)) {
      if (!history.has(name)) history.set(name, []);
      const points = history.get(name);
      points.push([now, value]);
      while (points.length && points[0][0] < now - 300) points.shift();
      if (!cards.has(name)) {
        const card = { value: el("div", { class: "value" }), chart: el("div", { class: "chart" }) };
        grid.append(el("div", { class: "panel card", "data-metric": name }, el("div", { class: "muted", text: name }),
                       card.value, card.chart));
        cards.set(name, card);
      }
      const card = cards.get(name);
      card.value.textContent = Number.isInteger(value) ? value.toLocaleString() : value.toFixed(3);
      card.chart.replaceChildren(sparkline(points));
    }
    await new Promise((resolve, reject) => {
      const timer = setTimeout(resolve, 5000);
      signal.addEventListener("abort", () => { clearTimeout(timer); reject(new DOMException("left", "AbortError")); });
    });
  }
}

function parseMetrics(text) {
  const sums = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|\+Inf|-Inf)/);
    if (!match || match[1].endsWith("_created") || match[1].endsWith("_bucket")) continue;
    const value = Number(match[3]);
    if (Number.isFinite(value)) sums.set(match[1], (sums.get(match[1]) || 0) + value);
  }
  return sums;
}

function sparkline(points) {
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", "0 0 100 30");
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", "the last five minutes");
  if (points.length > 1) {
    const [t0, t1] = [points[0][0], points[points.length - 1][0]];
    const values = points.map((p) => p[1]);
    const [lo, hi] = [Math.min(...values), Math.max(...values)];
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", points.map(([t, v]) =>
      `${((t - t0) / Math.max(1e-9, t1 - t0) * 100).toFixed(1)},${(28 - (v - lo) / Math.max(1e-9, hi - lo) * 26).toFixed(1)}`).join(" "));
    svg.append(line);
  }
  return svg;
}

// -- the operator's pages ---------------------------------------------------------------------

async function tenantsPage(signal) {
  const body = el("tbody");
  page("Tenants", el("p", { class: "muted", text: "Tenants, their limits and usage, and their keys' ids " +
    "(keys are stored hashed; create and revoke them with `corral keys`)." }),
    el("table", { "aria-label": "Tenants" },
      el("thead", {}, el("tr", {}, ["Tenant", "Sandboxes", "Commands / min", "Tiers", "Ceiling", "Keys"]
        .map((h) => el("th", { scope: "col", text: h })))), body));
  const rows = await (await api("/ui/api/tenants", { signal })).json();
  body.replaceChildren(...rows.map((t) => el("tr", { "data-tenant": t.name },
    el("td", {}, t.operator ? el("strong", { text: "operator" }) : t.name),
    el("td", { text: t.operator ? `${t.live_sandboxes}` : `${t.live_sandboxes} of ${t.max_sandboxes}` }),
    el("td", { text: t.commands_per_minute ?? "—" }),
    el("td", { text: (t.tiers || []).join(", ") || "all" }),
    el("td", {}, el("code", { text: t.ceiling && Object.keys(t.ceiling).length ? JSON.stringify(t.ceiling) : "server default" })),
    el("td", {}, t.keys.map((k) => el("span", { class: "label", text: `${k.id}${k.revoked ? " (revoked)" : ""}` }))))));
}

async function drillPage(signal) {
  const categories = el("div", { class: "row", role: "group", "aria-label": "Categories" });
  const state = el("p", { class: "muted", role: "status" });
  const report = el("div");
  const start = el("button", { class: "primary", type: "button", text: "Run the drill", disabled: true });
  page("Drill", el("p", { class: "muted", text: "Attacks a hijacked agent would try, run against this " +
    "service's own configuration: each case holds, or is a breach with its evidence. Pick categories, " +
    "or none for all (a few minutes)." }),
    categories, el("div", { class: "row" }, start), state, report);
  start.addEventListener("click", async () => {
    start.disabled = true;
    report.replaceChildren();
    try {
      const picked = [...categories.querySelectorAll("input:checked")].map((i) => i.value);
      let run = await (await api("/ui/api/drill", { method: "POST", json: { categories: picked }, signal })).json();
      while (run.state === "running") {
        state.textContent = `Running ${picked.join(", ") || "every category"}… ${Math.round(Date.now() / 1000 - run.started_at)} s`;
        await new Promise((resolve) => setTimeout(resolve, 1000));
        run = await (await api(`/ui/api/drill/${run.id}`, { signal })).json();
      }
      if (run.error) throw new Error(run.error);
      state.textContent = run.report.summary;
      report.replaceChildren(...drillReport(run.report));
    } catch (failure) { if (!signal.aborted) state.textContent = `The drill could not run: ${failure.message}`; }
    start.disabled = false;
  });
  // The drill's own list (the service asks the drill once): a case added there shows here.
  state.textContent = "Listing the drill's categories…";
  const listed = await (await api("/ui/api/drill", { signal })).json();
  categories.replaceChildren(...listed.categories.map((c) => el("label",
    { class: "check", title: `${c.cases} case${c.cases === 1 ? "" : "s"}` },
    el("input", { type: "checkbox", value: c.name }), ` ${c.name}`)));
  state.textContent = "";
  start.disabled = false;
}

function drillReport(report) {
  const verdict = { held: "ok", breached: "bad", error: "bad", skipped: "warn" };
  const byCategory = new Map();
  for (const result of report.results) {
    if (!byCategory.has(result.category)) byCategory.set(result.category, []);
    byCategory.get(result.category).push(result);
  }
  const evidence = (r) => r.evidence.filter((e) => e.sandbox).slice(0, 3).map((e) =>
    el("a", { href: `#/sandboxes/${e.sandbox}`, class: "label",
              text: `${e.event || e.kind}${e.seq ? ` #${e.seq}` : ""}` }));
  const row = (r) => el("tr", {},
    el("td", {}, el("code", { text: r.id })), el("td", {}, pill(r.verdict, verdict[r.verdict])),
    el("td", { class: "wrap", text: r.observed }), el("td", {}, evidence(r)));
  const section = ([category, results]) => el("section", { "data-category": category },
    el("h2", { text: `${category} (${results.filter((r) => r.verdict === "held").length}/${results.length} held)` }),
    el("table", { "aria-label": `Drill: ${category}` }, el("tbody", {}, results.map(row))));
  return [el("p", {}, pill(report.ok ? "holds" : "breached", report.ok ? "ok" : "bad")),
          ...[...byCategory].map(section)];
}

// -- routing ---------------------------------------------------------------------------------

async function route() {
  leave.abort();
  leave = new AbortController();
  const { signal } = leave;
  const hash = location.hash || "#/sandboxes";
  try {
    const sandbox = hash.match(/^#\/sandboxes\/(sbx_[a-z0-9]+)$/);
    if (sandbox) await sandboxPage(sandbox[1], signal);
    else if (hash === "#/egress") await egressPage(signal);
    else if (hash === "#/tenants") await tenantsPage(signal);
    else if (hash === "#/templates") await templatesPage(signal);
    else if (hash === "#/metrics") await metricsPage(signal);
    else if (hash === "#/drill") await drillPage(signal);
    else await sandboxesPage(signal);
  } catch (failure) {
    if (failure instanceof Unauthorized) signIn();
    else if (!signal.aborted && failure.name !== "AbortError") {
      main.append(el("p", { class: "error", role: "alert", text: failure.message }));
    }
  }
}

window.addEventListener("hashchange", route);
who().then(route, (failure) => signIn(failure instanceof Unauthorized ? "" : failure.message));
