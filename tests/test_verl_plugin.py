import subprocess
import sys

import pytest


def test_plugin_discovery_can_be_disabled():
    code = "import sys, verl; print('memupdate.verl_plugin' in sys.modules)"
    env = {"VERL_USE_EXTERNAL_PLUGINS": "none", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False"


#: What a process imports first: verl alone (a Ray worker only ever runs `import verl`, which must load our plugin),
#: or one of our modules.
FIRST_IMPORTS = [
    "verl",
    "memupdate.verl_plugin",
    "memupdate.agents.memory_loop",
    "memupdate.agents.memagent",
    "memupdate.tools.memory_tools",
    "memupdate.rewards.manager",
    "memupdate.rewards.memagent",
]


def _registries_after_importing(module: str) -> str:
    return (
        f"import importlib, logging, sys; logging.basicConfig(level=logging.ERROR); importlib.import_module({module!r})\n"
        "plugin_loaded = 'memupdate.verl_plugin' in sys.modules\n"
        "from verl.experimental.agent_loop.agent_loop import _agent_loop_registry\n"
        "from verl.experimental.reward_loop.reward_manager.registry import get_reward_manager_cls\n"
        "print(plugin_loaded,\n"
        "      sorted(k for k in _agent_loop_registry if k in ('memupdate_agent', 'memagent')),\n"
        "      get_reward_manager_cls('memupdate_memory').__name__, get_reward_manager_cls('memupdate_memagent').__name__)"
    )


@pytest.fixture(scope="module")
def first_imports() -> dict[str, tuple[int, str, str]]:
    """``(exit code, stdout, stderr)`` of a fresh process per module of FIRST_IMPORTS, all started at once: each
    spends most of its ~8 s importing verl on one core."""
    procs = {
        module: subprocess.Popen(
            [sys.executable, "-c", _registries_after_importing(module)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for module in FIRST_IMPORTS
    }
    outputs = {module: proc.communicate(timeout=300) for module, proc in procs.items()}
    return {module: (procs[module].returncode, *outputs[module]) for module in FIRST_IMPORTS}


@pytest.mark.parametrize("module", FIRST_IMPORTS)
def test_every_loop_and_reward_manager_registers_whichever_module_a_process_imports_first(module, first_imports):
    """`import verl` alone loads our plugin (a Ray worker runs nothing else) and its registrations. The first of
    our modules to import verl is still half-initialised while verl loads our plugin; no registration may then
    depend on a name from it (the eval_locomo log once showed the MemAgent loop missing after "cannot import name
    'next_request_id' from partially initialized module")."""
    code, stdout, stderr = first_imports[module]
    assert code == 0, stderr[-3000:]
    assert "failed" not in stderr and "partially initialized" not in stderr, stderr[-3000:]
    assert stdout.strip().splitlines()[-1:] == [
        "True ['memagent', 'memupdate_agent'] MemoryRewardManager MemAgentRewardManager"
    ], stderr[-3000:]
