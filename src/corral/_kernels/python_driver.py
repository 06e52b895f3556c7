"""The in-sandbox kernel driver: run as ``python3 -I -u -c <this source> <cwd> <language>``
inside the sandbox (never imported by the host, never written to the workspace). Python runs
in this process (IPython, else a plain fallback); bash, node (JavaScript and TypeScript) and R
run as its children, each speaking to this driver over a pipe of its own (so this driver keeps
every rule below for them too: the host sees one protocol whatever the language). Their
sources (``node_kernel.js``, ``r_kernel.R``) come in ``_SOURCES``, which ``driver_source()``
puts before this text.

Protocol, JSON lines. In (stdin): ``{"op": "exec", "id": N, "code": ..., "envs": {...}}`` and
``{"op": "interrupt"}``. Out (a private dup of the original stdout, so nothing the user's code or
its children print can reach it): ``ready`` (kernel, language), then per cell ``count``,
``stdout``/``stderr`` (text), ``result`` (MIME bundle, ``main``), ``error`` (name, value,
traceback) and ``end``. fd 1 and 2 point at pipes this driver forwards as stdout/stderr events.

Code in the kernel can still write to the protocol descriptor itself, so every message starts
on a line of its own (a newline before it ends whatever was written there), and no message is
longer than ``_MAX_LINE`` characters, the host's limit (its ``MAX_MESSAGE_CHARS``; a longer
line is dropped there): output goes in pieces, and a result or error too large to send is
replaced by an ``OutputTooLarge`` error.
"""

# This file runs under the sandbox's python3 (3.9+ and no third-party packages guaranteed):
# standard library only, and typed loosely on purpose.
# mypy: ignore-errors
# ruff: noqa

import ast
import base64
import json
import os
import select
import signal
import sys
import threading
import time
import traceback
import types

_MAX_LINE = 32 * 1024 * 1024  # the host's MAX_MESSAGE_CHARS (corral._control.interpreter)
# Output goes in events of at most this many characters: even escaped (six characters for one
# control character) a piece stays far under _MAX_LINE.
_PIECE = 1024 * 1024
_PROTO = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
_PROTO_LOCK = threading.Lock()
_CURRENT = {"id": None}
_FORWARDER = []  # the one _Forwarder, once fd 1 and 2 are pipes
_STREAMS = []  # sys.stdout and sys.stderr, once replaced
# One lock for all output (Python-level and fd-level), so the order of events is the order
# things were written in, and no two threads can deadlock on two locks.
_OUT_LOCK = threading.RLock()


def _flush_streams(but=None):
    with _OUT_LOCK:
        for stream in _STREAMS:
            if stream is not but:
                stream._flush()


# A partial line (a progress bar) goes out once it has waited this long, looked at every
# _TICK_S: within half a second. Only a line that waited: a timer that flushed whatever was
# pending would split a print's pieces ("a", " ", "b", "\n") whenever it fired between them.
_STALE_S = 0.3
_TICK_S = 0.2


def _flush_stale():
    now = time.monotonic()
    with _OUT_LOCK:
        for stream in _STREAMS:
            stream._flush_if_stale(now)


def emit(event, **fields):
    if event in ("stdout", "stderr") and len(fields["text"]) > _PIECE:
        text = fields.pop("text")
        for start in range(0, len(text), _PIECE):
            emit(event, text=text[start:start + _PIECE], **fields)
        return
    fields["ev"] = event
    if "id" not in fields:
        fields["id"] = _CURRENT["id"]
    if event in ("result", "error", "end") and _FORWARDER:
        _flush_streams()
        _FORWARDER[0].drain()  # child output written before this event goes first
    line = json.dumps(fields, ensure_ascii=False)
    if len(line) > _MAX_LINE:
        line = json.dumps({"ev": "error", "id": fields["id"], "name": "OutputTooLarge",
                           "value": f"a {event} of {len(line)} characters is over the "
                                    f"{_MAX_LINE}-character limit of one message and was not "
                                    "sent; write it to a file instead", "traceback": ""})
    with _PROTO_LOCK:
        # The newline first: bytes the user's code wrote here without one end before this.
        _PROTO.write("\n" + line + "\n")
        _PROTO.flush()


class _Forwarder:
    """fd 1 and 2 become pipes read here: output of child processes (``os.system``) and of C
    code lands in the cell's stdout/stderr events instead of in the protocol stream."""

    def __init__(self):
        self._pipes = {}
        self._lock = _OUT_LOCK
        for fd, name in ((1, "stdout"), (2, "stderr")):
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            os.set_blocking(r, False)
            self._pipes[r] = name
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        while True:
            ready, _, _ = select.select(list(self._pipes), [], [], _TICK_S)
            if ready:
                self.drain(ready)
            else:
                _flush_stale()  # a partial line (a progress bar) shows within 0.5 s

    def drain(self, fds=None):
        with self._lock:
            for fd in fds or list(self._pipes):
                while True:
                    try:
                        data = os.read(fd, 65536)
                    except BlockingIOError:
                        break
                    if not data:
                        break
                    _flush_streams()  # a partial Python line written before goes first
                    emit(self._pipes[fd], text=data.decode("utf-8", "replace"))


class _Stream:
    """sys.stdout/sys.stderr: Python-level writes become events, a line at a time (as
    Jupyter's streams coalesce ``print``'s pieces), in the order they were written across
    both streams and child processes; a partial line goes out when anything else does."""

    def __init__(self, name, forwarder):
        self.name = name
        self._forwarder = forwarder
        self._pending = []  # the partial line, in pieces: joined once, when it goes out
        self._size = 0
        self._since = 0.0  # when the partial line's first piece came
        self.encoding = "utf-8"
        self.errors = "replace"
        _STREAMS.append(self)

    def write(self, text):
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if text:
            with _OUT_LOCK:
                _flush_streams(but=self)  # the other stream's partial line was first
                self._forwarder.drain()  # and so was child output
                # Only the new text is searched: many small writes cost linear time.
                cut = text.rfind("\n") + 1
                self._hold(text[:cut] if cut else text)
                if cut or self._size >= _PIECE:  # a long partial line goes in pieces
                    self._flush()
                if 0 < cut < len(text):
                    self._hold(text[cut:])
        return len(text)

    def _hold(self, text):
        if not self._pending:
            self._since = time.monotonic()
        self._pending.append(text)
        self._size += len(text)

    def _flush_if_stale(self, now):
        if self._pending and now - self._since >= _STALE_S:
            self._flush()

    def _flush(self):
        if self._pending:
            text = "".join(self._pending)
            self._pending, self._size = [], 0
            emit(self.name, text=text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        with _OUT_LOCK:
            self._flush()

    def isatty(self):
        return False

    def fileno(self):
        return 1 if self.name == "stdout" else 2

    def readable(self):
        return False

    def writable(self):
        return True


# Figures the cell has already shown as its result (a figure as its last expression): its
# end shows the others only, so no figure comes twice.
_SHOWN = set()


def _figure_png(figure):
    """A figure as PNG bytes, as Jupyter's inline backend renders it; marked shown."""
    import io

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    _SHOWN.add(id(figure))
    return buffer.getvalue()


def _figure_text(figure):
    width, height = figure.get_size_inches() * figure.dpi
    return f"<Figure size {width:g}x{height:g} with {len(figure.axes)} Axes>"


def _is_figure(value):
    module = sys.modules.get("matplotlib.figure")
    return module is not None and isinstance(value, module.Figure)


def _figures():
    """Every open matplotlib figure not shown yet as a PNG display result, then all closed
    (the inline backend's behaviour: a cell's figures are shown at its end)."""
    if "matplotlib.pyplot" not in sys.modules:
        _SHOWN.clear()
        return []
    from matplotlib import _pylab_helpers

    bundles = []
    for manager in _pylab_helpers.Gcf.get_all_fig_managers():
        figure = manager.canvas.figure
        if id(figure) in _SHOWN or (not figure.axes and not figure.images):
            continue
        bundles.append({"image/png": base64.b64encode(_figure_png(figure)).decode(),
                        "text/plain": _figure_text(figure)})
    sys.modules["matplotlib.pyplot"].close("all")
    _SHOWN.clear()
    return bundles


def _show_figures(*_args, **_kwargs):
    for bundle in _figures():
        emit("result", main=False, data=bundle)


class _InlineBackend:
    """``MPLBACKEND=module://corral_inline``: Agg rendering, ``plt.show()`` returns the
    figures as PNG results (no display, no "non-interactive backend" warning)."""

    name = "corral_inline"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        import importlib.machinery

        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        from matplotlib.backend_bases import FigureManagerBase
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        module.FigureCanvas = FigureCanvasAgg
        module.FigureManager = FigureManagerBase
        module.show = _show_figures


def _error_fields(etype, value, tb_text):
    return {"name": getattr(etype, "__name__", str(etype)), "value": str(value),
            "traceback": tb_text}


class _PlainKernel:
    """No IPython: ``code``-module style. The last expression's repr is the cell's result."""

    kernel = "plain"

    def __init__(self):
        self.count = 0
        self.namespace = {"__name__": "__main__", "__builtins__": __builtins__}

    def run(self, code):
        self.count += 1
        emit("count", n=self.count)
        try:
            tree = ast.parse(code, "<cell>", "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, "<cell>", "exec"), self.namespace)
            if last is not None:
                value = eval(compile(last, "<cell>", "eval"), self.namespace)
                if value is not None:
                    self.namespace["_"] = value
                    data = {"text/plain": repr(value)}
                    if _is_figure(value):
                        data["image/png"] = base64.b64encode(_figure_png(value)).decode()
                    emit("result", main=True, data=data)
        except BaseException as exc:  # the cell's error, whatever it is
            if isinstance(exc, SystemExit):
                raise
            frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
            # Drop this driver's own frame: the user's traceback starts in the cell.
            text = "".join(f for f in frames if "python_driver" not in f and "<string>" not in f)
            emit("error", **_error_fields(type(exc), exc, text))
        _show_figures()


def _ipython_kernel():
    """IPython's InteractiveShell with its display machinery pointed at the protocol."""
    from IPython.core.displayhook import DisplayHook
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    class Hook(DisplayHook):
        def write_output_prompt(self):
            pass

        def write_format_data(self, format_dict, md_dict=None):
            emit("result", main=True, data=_jsonable(format_dict))

        def finish_displayhook(self):
            pass

    class Publisher(DisplayPublisher):
        def publish(self, data, metadata=None, source=None, *, transient=None, update=False,
                    **kwargs):
            emit("result", main=False, data=_jsonable(data))

        def clear_output(self, wait=False):
            pass

    class Shell(InteractiveShell):
        displayhook_class = Hook
        display_pub_class = Publisher

        def _showtraceback(self, etype, evalue, stb):
            emit("error", **_error_fields(etype, evalue, "\n".join(stb)))

        def enable_gui(self, gui=None):
            pass

    config = Config()
    config.HistoryManager.enabled = False  # no sqlite history file anywhere
    config.InteractiveShell.colors = "NoColor"
    config.InteractiveShell.autocall = 0
    shell = Shell.instance(config=config)
    shell.display_formatter.active_types = list(shell.display_formatter.format_types)
    # A figure as the cell's last expression is its result with its PNG, as with Jupyter's
    # inline backend (by name: matplotlib is imported only if the cell does).
    shell.display_formatter.formatters["image/png"].for_type_by_name(
        "matplotlib.figure", "Figure", _figure_png)

    class Kernel:
        kernel = "ipython"

        @property
        def count(self):
            return shell.execution_count

        def run(self, code):
            emit("count", n=shell.execution_count)
            result = shell.run_cell(code, store_history=True)
            _show_figures()
            if result.error_in_exec is not None and isinstance(result.error_in_exec,
                                                                 SystemExit):
                raise result.error_in_exec

    return Kernel()


class _BashKernel:
    """One persistent ``bash`` per context: cwd, variables and functions stay across cells. A
    cell is read into a variable by the builtin ``read`` (heredoc with a fresh delimiter, so
    no quoting of the code is needed) and ``eval``-ed; its status comes back on a pipe."""

    kernel = "bash"

    def __init__(self):
        import subprocess

        self.count = 0
        self._status_r, status_w = os.pipe()
        self._bash = subprocess.Popen(
            ["bash", "--noprofile", "--norc"], stdin=subprocess.PIPE, stdout=1, stderr=2,
            pass_fds=(status_w,), start_new_session=True)
        self._status_fd = status_w
        os.close(status_w)  # bash holds the only write end: EOF means bash has gone
        # The cell runs in a function so Ctrl-C can end it (``return`` in the trap) and leave
        # the shell alive; a handler, not "ignore", which children would inherit.
        self._send("__corral_run() { eval \"$__corral_cell\"; }\n"
                   "trap 'return 130 2>/dev/null' INT\n")

    def _send(self, text):
        self._bash.stdin.write(text.encode())
        self._bash.stdin.flush()

    def interrupt(self):
        self.interrupted = True
        try:
            os.killpg(self._bash.pid, signal.SIGINT)
        except ProcessLookupError:
            pass

    def run(self, code):
        self.count += 1
        self.interrupted = False
        emit("count", n=self.count)
        delimiter = "__CORRAL_CELL_" + os.urandom(8).hex() + "__"
        self._send(f"IFS= read -r -d '' __corral_cell <<'{delimiter}'\n{code}\n{delimiter}\n"
                   f"__corral_run; echo \"$?\" >&{self._status_fd}\n")
        status = b""
        while not status.endswith(b"\n"):
            chunk = os.read(self._status_r, 64)
            if not chunk:
                emit("error", name="KernelExited",
                     value="bash exited (exit in a cell?); the next cell starts a fresh one",
                     traceback="")
                raise SystemExit(0)
            status += chunk
        code = int(status.strip() or b"0")
        if code == 130 and self.interrupted:
            raise KeyboardInterrupt
        if code != 0:
            emit("error", name="CommandExitError", value=f"exit status {code}", traceback="")


class _NodeKernel:
    """``node`` with one persistent ``vm`` context per kernel (``node_kernel.js``), for
    JavaScript and TypeScript. Its console writes to the driver's forwarded fd 1 and 2; its
    protocol has a pipe of its own, so a child process's output cannot reach it either."""

    kernel = "node"

    def __init__(self, language):
        import shutil
        import subprocess

        node = shutil.which("node") or shutil.which("nodejs")
        if node is None:
            raise RuntimeError("node is not installed in this sandbox's template; the "
                               "code-interpreter template has it (Debian's nodejs)")
        self.count = 0
        read_end, write_end = os.pipe()
        self._node = subprocess.Popen(
            [node, "-e", _SOURCES["node"], str(write_end), language], stdin=subprocess.PIPE,
            stdout=1, stderr=2, pass_fds=(write_end,))
        os.close(write_end)
        # Bounded reads: a line longer than the host's limit is the tenant's (code in the
        # context can write to this pipe) and is cut, never held whole.
        self._proto = os.fdopen(read_end, "r", encoding="utf-8", errors="replace")
        first = self._next()
        if first is None:
            raise RuntimeError("node exited as it started")
        if first.get("ev") == "fatal":
            raise RuntimeError(str(first.get("message")))
        if first.get("ev") != "ready":
            raise RuntimeError("node did not start")

    def _next(self):
        while True:
            line = self._proto.readline(_MAX_LINE)
            if not line:
                return None
            try:
                message = json.loads(line)
            except ValueError:
                continue  # not a message of the kernel's: written there by the cell
            if isinstance(message, dict) and isinstance(message.get("ev"), str):
                return message

    def interrupt(self):
        try:
            self._node.send_signal(signal.SIGINT)  # vm's breakOnSigint ends the cell only
        except ProcessLookupError:
            pass

    def run(self, code):
        self.count += 1
        emit("count", n=self.count)
        self._node.stdin.write((json.dumps({"code": code}) + "\n").encode())
        self._node.stdin.flush()
        while True:
            message = self._next()
            if message is None:
                emit("error", name="KernelExited", value="node exited; the next cell starts "
                     "a fresh one", traceback="")
                raise SystemExit(0)
            kind = message.pop("ev")
            if kind == "end":
                return
            if kind == "result" and isinstance(message.get("data"), dict):
                emit("result", main=True, data=message["data"])
            elif kind == "error":
                emit("error", **_error_message(message))


def _error_message(message):
    return {key: str(message.get(key, "")) for key in ("name", "value", "traceback")}


_R_ENVIRON_COPY = "/usr/lib/R/etc/Renviron.ucf"


class _RKernel:
    """``Rscript`` running ``r_kernel.R``: cells go to its stdin with their length, what it
    says comes back in length-prefixed frames on a pipe of its own, turned here into the
    protocol's messages (a plot's PNG file read, sent and removed)."""

    kernel = "r"

    def __init__(self):
        import shutil
        import subprocess

        rscript = shutil.which("Rscript")
        if rscript is None:
            raise RuntimeError("R is not installed in this sandbox's template; the "
                               "code-interpreter template has it (Debian's r-base-core)")
        self.count = 0
        self.interrupted = False
        read_end, write_end = os.pipe()
        env = dict(os.environ, CORRAL_R_KERNEL=_SOURCES["r"], CORRAL_R_PROTO=str(write_end))
        # Debian's R reads its settings from /etc/R/Renviron, which a template built on the
        # host's /usr alone (base) lacks (without them R's utils fails to load); the packaged
        # copy under /usr is the same file, read as the site file instead.
        if not os.path.exists("/etc/R/Renviron") and os.path.exists(_R_ENVIRON_COPY):
            env["R_ENVIRON"] = _R_ENVIRON_COPY
        # The source comes in the environment (R keeps at most 10,000 characters of -e); the
        # kernel unsets it before any cell runs.
        self._r = subprocess.Popen(
            [rscript, "--no-save", "--no-restore", "--no-site-file", "--no-init-file", "-e",
             "eval(parse(text = Sys.getenv('CORRAL_R_KERNEL')))"],
            stdin=subprocess.PIPE, stdout=1, stderr=2, pass_fds=(write_end,), env=env)
        os.close(write_end)
        self._proto = os.fdopen(read_end, "rb")
        first = self._frame()
        if first is None or first[0] != "ready":
            raise RuntimeError("R did not start")

    def _frame(self):
        """(kind, bytes), or None at the end of the stream. Anything but a well-formed frame
        (the cell wrote to the pipe) is a ``broken`` one: the stream cannot be followed."""
        header = self._proto.readline(64)
        if not header:
            return None
        kind, _, size = header.decode("ascii", "replace").strip().partition(" ")
        if not header.endswith(b"\n") or not size.isdigit() or int(size) > _MAX_LINE:
            return ("broken", b"")
        data = self._proto.read(int(size))
        return (kind, data) if len(data) == int(size) else None

    def interrupt(self):
        self.interrupted = True
        try:
            self._r.send_signal(signal.SIGINT)  # R's interrupt condition, caught per cell
        except ProcessLookupError:
            pass

    def _display(self, path):
        try:
            with open(path, "rb") as f:
                png = f.read(_MAX_LINE)
            os.unlink(path)
        except OSError as exc:
            emit("stderr", text=f"[corral: a plot could not be read: {exc}]\n")
            return
        emit("result", main=False, data={"image/png": base64.b64encode(png).decode(),
                                         "text/plain": "<R plot>"})

    def run(self, code):
        self.count += 1
        self.interrupted = False
        emit("count", n=self.count)
        data = code.encode("utf-8", "replace")
        self._r.stdin.write(f"{len(data):012d}".encode() + data)
        self._r.stdin.flush()
        while True:
            frame = self._frame()
            if frame is None or frame[0] == "broken":
                emit("error", name="KernelExited", value="R exited (quit() in a cell?); the "
                     "next cell starts a fresh one" if frame is None else "the R kernel's "
                     "stream was written to by the cell; the next cell starts a fresh kernel",
                     traceback="")
                raise SystemExit(0)
            kind, payload = frame
            text = payload.decode("utf-8", "replace")
            if kind == "end":
                return
            if kind == "result":
                emit("result", main=True, data={"text/plain": text})
            elif kind == "display":
                self._display(text)
            elif kind == "error":
                name, value, traceback_text = (text.split("\0") + ["", ""])[:3]
                emit("error", name=name, value=value, traceback=traceback_text)


def _jsonable(bundle):
    out = {}
    for mime, value in bundle.items():
        if isinstance(value, bytes):
            value = base64.b64encode(value).decode()
        out[mime] = value
    return out


class _Inbox:
    """stdin, read on its own thread: an ``interrupt`` must arrive while a cell runs."""

    def __init__(self, interrupt=None):
        self._interrupt = interrupt
        self._cond = threading.Condition()
        self._queue = []
        self.busy = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in sys.__stdin__:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if message.get("op") == "interrupt":
                with self._cond:
                    busy = self.busy
                if busy and self._interrupt is not None:
                    self._interrupt()
                elif busy:
                    # A real signal (not interrupt_main's flag), so a blocking call such as
                    # time.sleep or a read returns EINTR and KeyboardInterrupt is raised.
                    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                continue
            with self._cond:
                self._queue.append(message)
                self._cond.notify()
        with self._cond:
            self._queue.append(None)
            self._cond.notify()

    def next(self):
        with self._cond:
            self._cond.wait_for(lambda: self._queue)
            message = self._queue.pop(0)
            self.busy = message is not None
            return message

    def done(self):
        with self._cond:
            self.busy = False


def _user_site():
    """``pip install`` in a sandbox installs into the user's site ($HOME/.local, the
    workspace: the root is read-only), which ``-I`` leaves out: put it back, before the
    system's packages as Python's own site does, even if it does not exist yet."""
    if sys.flags.no_site:
        return None
    import site

    path = site.getusersitepackages()
    if path not in sys.path:
        system = [i for i, p in enumerate(sys.path) if p.endswith(("-packages", "-packages/"))]
        sys.path.insert(system[0] if system else len(sys.path), path)
    return path


def _forget_missing(path):
    """A directory that did not exist at an import is remembered as having no modules: once
    it exists (``!pip install`` in the last cell), look again."""
    if path is not None and sys.path_importer_cache.get(path, False) is None:
        del sys.path_importer_cache[path]


def main():
    if len(sys.argv) > 1 and sys.argv[1]:
        os.chdir(sys.argv[1])
    sys.path.insert(0, os.getcwd())  # -I drops the cwd; a kernel imports the user's modules
    user_site = _user_site()
    os.environ.setdefault("MPLBACKEND", "module://" + _InlineBackend.name)
    # Debian's matplotlib reads /etc/matplotlibrc, which a template built on the host's /usr
    # alone (base) lacks; the packaged copy under /usr is the same file.
    if "MATPLOTLIBRC" not in os.environ and not os.path.exists("/etc/matplotlibrc"):
        os.environ["MATPLOTLIBRC"] = "/usr/share/matplotlib/mpl-data"
    sys.meta_path.append(_InlineBackend())
    forwarder = _Forwarder()
    _FORWARDER.append(forwarder)
    sys.stdout = _Stream("stdout", forwarder)
    sys.stderr = _Stream("stderr", forwarder)
    language = sys.argv[2] if len(sys.argv) > 2 else "python"
    try:
        if language == "bash":
            kernel = _BashKernel()
        elif language in ("javascript", "typescript"):
            kernel = _NodeKernel(language)
        elif language == "r":
            kernel = _RKernel()
        else:
            try:
                kernel = _ipython_kernel()
            except ImportError:
                kernel = _PlainKernel()
    except Exception as exc:  # said on the protocol: the host refuses with this reason
        emit("fatal", message=f"the {language} kernel could not start: {exc}")
        os._exit(3)
    inbox = _Inbox(getattr(kernel, "interrupt", None))
    # An interrupt is for the cell that runs: one landing between cells (sent just as a cell
    # ended, or before the next one began) must not end the kernel and everything it holds.
    in_cell = [False]

    def on_sigint(signum, frame):
        if in_cell[0]:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    emit("ready", kernel=kernel.kernel, language=language, pid=os.getpid())
    while True:
        message = inbox.next()
        if message is None:
            return
        _CURRENT["id"] = message.get("id")
        envs = message.get("envs") or {}
        saved = {name: os.environ.get(name) for name in envs}
        try:
            os.environ.update(envs)  # for this cell only, as E2B's env_vars
            try:
                in_cell[0] = True
                _forget_missing(user_site)
                try:
                    kernel.run(message.get("code", ""))
                finally:
                    in_cell[0] = False
            except KeyboardInterrupt:
                emit("error", name="KeyboardInterrupt", value="", traceback="KeyboardInterrupt")
        except SystemExit as exc:
            if exc.code:
                emit("error", name="SystemExit", value=str(exc.code),
                     traceback="SystemExit: the kernel exited; the next cell starts a fresh one")
            forwarder.drain()
            emit("end")
            os._exit(0)
        except KeyboardInterrupt:
            emit("error", name="KeyboardInterrupt", value="", traceback="KeyboardInterrupt")
        finally:
            inbox.done()
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        forwarder.drain()
        emit("end")


main()
