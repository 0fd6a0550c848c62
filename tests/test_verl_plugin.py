import subprocess
import sys


def test_bare_import_verl_loads_the_memupdate_plugin():
    # A fresh interpreter stands in for a Ray worker: it only ever runs `import verl`.
    code = "import sys, verl; print('memupdate.verl_plugin' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "True"


def test_plugin_discovery_can_be_disabled():
    code = "import sys, verl; print('memupdate.verl_plugin' in sys.modules)"
    env = {"VERL_USE_EXTERNAL_PLUGINS": "none", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False"
