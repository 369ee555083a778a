"""`python -m engine.model.kernels`: build (or find) this machine's native CPU kernels
now, so that the first engine start, or the first test that needs them, does not spend
a minute and a half compiling them. `make setup` runs it; without a compiler the engine
still works, on torch ops, and this says so."""
import sys
import time

from engine.model.kernels import cpu_kernels

started = time.monotonic()
module = cpu_kernels()
if module is None:
    print("native CPU kernels unavailable: the engine will use torch ops")
else:
    print(f"native CPU kernels ready ({module.isa}) after {time.monotonic() - started:.0f} s")
sys.exit(0)
