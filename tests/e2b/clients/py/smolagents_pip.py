"""smolagents' ``E2BExecutor`` (``smolagents[e2b]``, issue 37) against ``corral serve``: a
``CodeAgent`` with ``executor_type="e2b"`` and a scripted model (no LLM) imports a package the
executor installs with ``!pip install`` from the operator's package index, which the tenant's
ceiling allows.

Runs in the ``smolagents`` set (.venv-e2b/smolagents/). Usage: python smolagents_pip.py PACKAGE
"""

from __future__ import annotations

import sys
from typing import Any

from _steps import done, step
from smolagents import CodeAgent
from smolagents.models import ChatMessage, MessageRole, Model

package = sys.argv[1]


class ScriptedModel(Model):
    """Answers each call with the next canned reply (smolagents' ``Model`` interface)."""

    def __init__(self, replies: list[str]) -> None:
        super().__init__(model_id="scripted")
        self.replies = list(replies)

    def generate(self, messages: list[Any], stop_sequences: list[str] | None = None,
                 response_format: dict[str, str] | None = None,
                 tools_to_call_from: list[Any] | None = None, **kwargs: Any) -> ChatMessage:
        # Past the script the agent is told to stop, so a failed step ends the run at once.
        reply = self.replies.pop(0) if self.replies else (
            "Thought: out of script.\n<code>\nfinal_answer('script exhausted')\n</code>")
        return ChatMessage(role=MessageRole.ASSISTANT, content=reply)


model = ScriptedModel([
    f"Thought: the package is installed; read its value.\n<code>\nimport {package}\n"
    f"print({package}.__file__)\nfinal_answer({package}.VALUE)\n</code>",
])


def make_agent() -> CodeAgent:
    # The executor is made here: it creates the sandbox and runs `!pip install PACKAGE`.
    # allow_internet_access=True: on Corral it means "what the tenant's ceiling allows".
    return CodeAgent(tools=[], model=model, executor_type="e2b",
                     additional_authorized_imports=[package],
                     executor_kwargs={"timeout": 900, "allow_internet_access": True},
                     max_steps=2, verbosity_level=0)


# Bounds far above the work (seconds on a quiet host): with CPU hogs beside the suite the
# sandbox's start and its pip run took minutes.
agent = step("agent", make_agent, seconds=240)
if agent is not None:
    executor: Any = agent.python_executor
    step("sandbox_id", lambda: executor.sandbox.sandbox_id)
    step("installed", lambda: list(executor.installed_packages))
    step("run", lambda: agent.run("What VALUE does the package hold?"), seconds=180)
    step("pip_again", lambda: executor.run_code_raise_errors(
        f"!pip install {package}").logs[-1500:], seconds=120)
    step("observations", lambda: [str(getattr(s, "observations", None) or "")[-1500:]
                                  for s in agent.memory.steps][-3:])
    step("error_of_steps", lambda: [str(getattr(s, "error", None) or "")[-1500:]
                                    for s in agent.memory.steps][-3:])
    step("cleanup", agent.cleanup)
done()
