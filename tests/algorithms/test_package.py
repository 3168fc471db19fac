"""ketch.algorithms stands alone: it imports no other ketch module but `ketch.registry` (its registries)."""

import subprocess
import sys


def test_importing_algorithms_loads_no_other_ketch_module_but_the_registry():
    code = (
        "import sys, ketch.algorithms\n"
        "print(sorted(m for m in sys.modules if m.startswith('ketch') and not m.startswith('ketch.algorithms')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['ketch', 'ketch.registry']"
