"""The OpenAI Agents SDK's own E2B sandbox client (``openai-agents[e2b]``, issue 37) against
``corral serve``, driven by the SDK's own ``Runner`` and a scripted model: no LLM, no network
beyond the E2B listener.

The model asks for a shell command (``exec_command``), then ``apply_patch`` creating a file,
then ``apply_patch`` editing it, then a shell command reading it back, then answers. Runs in the
``agents`` set (.venv-e2b/agents/), whose e2b / e2b-code-interpreter are the versions
openai-agents itself pins. Usage: python openai_agents.py SANDBOX_TYPE [ON_TIMEOUT]
(``e2b`` or ``e2b_code_interpreter``; ``kill`` or ``pause``, else the client's default)
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from _steps import done, step
from agents import RunConfig, Runner, set_tracing_disabled
from agents.extensions.sandbox.e2b import E2BSandboxClient, E2BSandboxClientOptions
from agents.items import ToolCallOutputItem
from agents.run_config import SandboxRunConfig
from agents.sandbox import Manifest, SandboxAgent
from agents.testing import ScriptedModel, assistant_message, function_call
from openai.types.responses import ResponseCustomToolCall

set_tracing_disabled(True)  # tracing would export to OpenAI
sandbox_type = sys.argv[1] if len(sys.argv) > 1 else "e2b"
# Unset: E2BSandboxClientOptions' own default (on_timeout="pause", auto_resume=True).
lifecycle = {"on_timeout": sys.argv[2]} if len(sys.argv) > 2 else {}
loop = asyncio.new_event_loop()

CREATE = ("*** Begin Patch\n*** Add File: notes/hello.py\n+print('hello')\n+print('corral')\n"
          "*** End Patch")
EDIT = ("*** Begin Patch\n*** Update File: notes/hello.py\n@@\n print('hello')\n"
        "-print('corral')\n+print('patched')\n*** End Patch")


def patch(call_id: str, text: str) -> ResponseCustomToolCall:
    return ResponseCustomToolCall(type="custom_tool_call", id=call_id, call_id=call_id,
                                  name="apply_patch", input=text)


def shell(call_id: str, cmd: str) -> Any:
    return function_call("exec_command", {"cmd": cmd, "yield_time_ms": 20000}, call_id=call_id)


model = ScriptedModel([
    [shell("c1", "pwd; echo $((6 * 7)) > answer.txt; cat answer.txt; ls /tmp/openai-agents")],
    [patch("c2", CREATE)],
    [patch("c3", EDIT)],
    [shell("c4", "python3 notes/hello.py; cat answer.txt")],
    [assistant_message("done: hello.py patched")],
])
agent = SandboxAgent(name="corral-e2b", instructions="Use the sandbox.", model=model,
                     default_manifest=Manifest())
client = E2BSandboxClient()
options = E2BSandboxClientOptions(sandbox_type=sandbox_type, timeout=300,
                                  metadata={"suite": "frameworks"}, **lifecycle)


def run() -> dict[str, Any]:
    result = loop.run_until_complete(Runner.run(
        agent, "Write answer.txt and notes/hello.py, then patch it.", max_turns=8,
        run_config=RunConfig(sandbox=SandboxRunConfig(client=client, options=options))))
    state = getattr(result, "_sandbox_resume_state", None) or {}
    outputs = {str(item.raw_item["call_id"] if isinstance(item.raw_item, dict)
                   else item.raw_item.call_id): str(item.output)
               for item in result.new_items if isinstance(item, ToolCallOutputItem)}
    return {"final": result.final_output, "outputs": outputs,
            "sandbox_id": state.get("session_state", state).get("sandbox_id")
            if isinstance(state, dict) else None,
            "remaining_steps": model.remaining_steps}


step("run", run, seconds=240)
done()
