"""Each compiled kernel runs its own copies of the kernels it calls, whether this process compiled
it or loaded it from Numba's cache.

Numba links a callee's optimized module into each caller's and marks the copy `linkonce_odr` (one
definition rule: any copy may stand for any other). The JIT then binds a caller's calls to the
first definition it loaded. In a process that compiled the callee itself, that is the callee's
own build; in one that loaded the caller from the cache, the copy inside the caller, optimized
again there. Under fastmath (reassociated sums, fused multiply-adds) the two round differently:
`row_attention_kernel`'s decode step gave outputs 1e-7 apart, depending only on which of its
kernels came from the cache, so a fresh clone's first tests (or a server's first run after an
install) computed other bits than every later run. Making the linked copies `internal` once the
caller's module is optimized binds each caller to its own copy in every process, compiled as
before: the bits the cache gave, now cold and warm. (Made internal before, the copies were inlined
further: a cold load of the synthetic MoE compiled for 66 s, not 52.)
"""

from __future__ import annotations

import llvmlite.binding as llvm
from numba.core.codegen import CPUCodeLibrary

_optimize_final_module = CPUCodeLibrary._optimize_final_module  # noqa: SLF001


def _optimize_own_copies(self: CPUCodeLibrary) -> None:
    """Numba's final optimization of a library, then its linked callees made its own. The module
    that callers link is Numba's (`_get_module_for_linking`'s: this one's functions and its
    copies `linkonce_odr`), taken first, so a caller's copies still merge with one another as
    before: internal ones there took about 16% longer to compile (the kernel tests, cold)."""
    _optimize_final_module(self)
    module = self._final_module  # noqa: SLF001
    shared = module.clone()
    for function in shared.functions:
        if not function.is_declaration and function.linkage == llvm.Linkage.external:
            function.linkage = "linkonce_odr"
    self._shared_module = shared  # noqa: SLF001
    for function in module.functions:
        if not function.is_declaration and function.linkage == llvm.Linkage.linkonce_odr:
            function.linkage = "internal"


CPUCodeLibrary._optimize_final_module = _optimize_own_copies  # noqa: SLF001
