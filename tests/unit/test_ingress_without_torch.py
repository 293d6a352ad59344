"""The Ray ingress (routing, config, the ingress deployment) runs in processes without torch: a
subprocess whose import system refuses torch imports them all."""

import subprocess
import sys

BLOCKED = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not installed here")

sys.meta_path.insert(0, NoTorch())
import hotlora.scaleout.config, hotlora.scaleout.ingress, hotlora.scaleout.routing
import hotlora.adapters.store.references
assert "torch" not in sys.modules
try:
    import hotlora.adapters.format.convert
except ImportError:
    print("blocked")
"""


def test_the_ingress_imports_with_torch_absent():
    done = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "blocked"  # the block works: what needs torch fails to import
