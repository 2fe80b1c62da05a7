"""Host memory measured in a fresh process (Linux): a 168 MB stack of 40 linear layers, its checkpoint saved by
one process, loaded by another whose peak resident size (VmHWM) restarts just before the code measured."""

import subprocess
import sys
import textwrap
from pathlib import Path

BLOCK_BYTES = (1024 * 1024 + 1024) * 4

_PROLOGUE = textwrap.dedent("""
    import sys, torch
    from torch import nn
    from offload_compiler import OffloadPolicy, empty_weights, offload_compile, offload_stats
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(1024, 1024) for _ in range(40))
        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x
    if sys.argv[1] == "save":
        from safetensors.torch import save_file
        save_file(Stack().state_dict(), sys.argv[2])
        sys.exit()
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
    with empty_weights():
        model = Stack()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) restarts from the resident size now
    before = status("VmRSS:")
""")


def stack_script(folder: Path, body: str) -> tuple[Path, str]:
    """A script that builds the stack with its parameters on meta, restarts the peak and runs ``body`` (which
    sees ``model``, ``before``, ``status`` and the checkpoint path as ``sys.argv[2]``), and that checkpoint."""
    script = folder / "stack.py"
    script.write_text(_PROLOGUE + textwrap.dedent(body))
    path = str(folder / "stack.safetensors")
    subprocess.run([sys.executable, str(script), "save", path], check=True)
    return script, path


def run(script: Path, *args: str) -> list[int]:
    """The integers the script prints."""
    out = subprocess.run([sys.executable, str(script), *args], check=True, capture_output=True, text=True)
    return [int(word) for word in out.stdout.split()]
