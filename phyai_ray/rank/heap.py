"""The garbage collector and a replica's long-lived objects.

A process that serves a model holds hundreds of thousands of objects that live as long as it does
(torch, transformers and their imports, the plugin's modules, the config). CPython's cyclic collector
walks all of them in every full collection: in a process that imported transformers, one full pass
took 313 ms on a 2-core VM, a pause in the middle of an iteration every few seconds of decoding.
`hold()` runs once a rank's plugin is built: it freezes every object then alive
(`gc.freeze`: later collections skip them; nothing is collected or copied), so a collection walks
only what was made since. The freeze is released when the last replica of the process closes
(`release()`), so objects frozen with a closed engine can be collected again; a freeze the
process made itself before the first replica is left as it was.

Nothing here changes what is freed: objects keep their reference counts; only cycles among frozen
objects wait for the release to be collected.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holders = 0
_ours = False  # the first holder found no freeze of the process's own: the last release undoes it


def hold() -> None:
    """Freeze every object alive now (a replica's plugin was just built)."""
    global _holders, _ours
    with _lock:
        if _holders == 0:
            _ours = gc.get_freeze_count() == 0
        _holders += 1
        gc.freeze()


def release() -> None:
    """A replica closed: the last one gives the frozen objects back to the collector."""
    global _holders
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0 and _ours:
            gc.unfreeze()
