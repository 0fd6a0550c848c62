import subprocess
import sys


def test_bare_import_verl_loads_the_memupdate_plugin():
    # A fresh interpreter stands in for a Ray worker: it only ever runs `import verl`.
    code = "import sys, verl; print('memupdate.verl_plugin' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "True"


def test_plugin_registers_the_agent_loop_and_reward_manager():
    code = (
        "import verl\n"
        "from verl.experimental.agent_loop.agent_loop import _agent_loop_registry\n"
        "from verl.experimental.reward_loop.reward_manager.registry import get_reward_manager_cls\n"
        "print('memupdate_agent' in _agent_loop_registry, get_reward_manager_cls('memupdate_memory').__name__)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "True MemoryRewardManager"


def test_plugin_discovery_can_be_disabled():
    code = "import sys, verl; print('memupdate.verl_plugin' in sys.modules)"
    env = {"VERL_USE_EXTERNAL_PLUGINS": "none", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False"
