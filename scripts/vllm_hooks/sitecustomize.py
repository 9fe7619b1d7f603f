"""Stack dumps of every Python process of a vLLM run (issue 22: the MXFP8 MoE hang).

Put this folder first on PYTHONPATH and set ``MXREFIT_FAULTHANDLER=<dir>``: every Python
process that starts (the script, vLLM's engine core and workers, spawned or forked) writes
all its threads' stacks to ``<dir>/fh_<pid>.txt`` on SIGUSR1, and every
``MXREFIT_FAULTHANDLER_S`` seconds if that is set (a timer; a forked child re-arms it).
``scripts/vllm_moe_hang.py`` sends SIGUSR1 to the whole process tree before it kills a hung
start. Seen on the H200 (2026-12-04): the periodic timer (``MXREFIT_FAULTHANDLER_S=20``) killed
vLLM processes with SIGSEGV during their imports and stalled others; SIGUSR1 alone did not. Python has no py-spy here; faulthandler is in the standard library.
"""

import os

_DIR = os.environ.get("MXREFIT_FAULTHANDLER")


def _arm() -> None:
    import faulthandler
    import signal
    import sys

    try:
        os.makedirs(_DIR, exist_ok=True)
        f = open(os.path.join(_DIR, f"fh_{os.getpid()}.txt"), "w", buffering=1)  # noqa: SIM115 - lives as long as the process
        f.write(f"pid {os.getpid()} ppid {os.getppid()} argv {getattr(sys, 'argv', None)!r}\n")
        faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)
        period = float(os.environ.get("MXREFIT_FAULTHANDLER_S", "0") or 0)
        if period > 0:
            faulthandler.dump_traceback_later(period, repeat=True, file=f)
        globals()["_FILE"] = f  # keep the file object (and its fd) alive
    except Exception as err:  # noqa: BLE001 - never break the interpreter's start
        print(f"sitecustomize: faulthandler not armed: {err}", file=sys.stderr)


if _DIR:
    _arm()
    os.register_at_fork(after_in_child=_arm)
