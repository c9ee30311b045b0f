"""The signal a backend gives when it cannot serve a call exactly, in a module of its own: the dispatcher
(:mod:`hybridlm.ops.backends`) catches it and the kernels and adapters raise it, so neither imports the other
for it."""


class Declined(Exception):
    """Raised by a backend, before returning anything, for a call it cannot serve exactly (an adapter's library
    cannot, a dtype or state size our kernel does not take, a Triton kernel that fails to compile for this GPU):
    the default plan runs the next backend, a forced backend raises
    :class:`~hybridlm.ops.backends.BackendUnavailable`."""
