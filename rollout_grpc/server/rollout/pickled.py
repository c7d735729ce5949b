"""The values the shared state store keeps as pickles, and the restricted reading of them.

The store is shared (the supervisor of `--workers N`, or a Redis every replica reaches); a
replica's memory is not. So what comes back from it is read by an unpickler that resolves only
the globals a value of ours can name: our own modules' types (`modules`, by prefix), numpy arrays
(routed experts, logprobs) and the plain containers pickle rebuilds them with. A blob naming
anything else (`os.system`, a class of another package) is refused before it is built.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: The globals every kept value may name besides our modules: numpy arrays and their dtypes (both
#: module paths numpy 1 and 2 pickle them under) and what pickle rebuilds plain objects with.
PLAIN_GLOBALS = frozenset(
    {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("copyreg", "_reconstructor"),
        ("copyreg", "__newobj__"),
        ("builtins", "object"),
    }
)


class RestrictedPickle(Generic[T]):
    """Encodes values of type `kind` for the store and reads them back, refusing any other global."""

    def __init__(
        self,
        kind: type[T],
        what: str,
        modules: tuple[str, ...],
        extra_globals: frozenset[tuple[str, str]] = frozenset(),
    ) -> None:
        #: The one type a blob must decode to.
        self.kind = kind
        #: How errors name a value ("a buffered group").
        self.what = what
        #: Module prefixes (ending in ".") whose globals a blob may name.
        self.modules = modules
        self.allowed = PLAIN_GLOBALS | extra_globals

    def encode(self, value: T) -> bytes:
        """`value` as the store keeps it."""
        return pickle.dumps(value, protocol=5)

    def decode(self, blob: bytes) -> T:
        """A value the store kept; `pickle.UnpicklingError` when it names a global not allowed or
        is not a `kind`."""
        value = _Unpickler(self, io.BytesIO(blob)).load()
        if not isinstance(value, self.kind):
            raise pickle.UnpicklingError(f"{self.what} decoded to {type(value).__name__}")
        return value


class _Unpickler(pickle.Unpickler):
    def __init__(self, codec: RestrictedPickle[Any], file: io.BytesIO) -> None:
        super().__init__(file)
        self._codec = codec

    def find_class(self, module: str, name: str) -> Any:
        codec = self._codec
        if (module, name) in codec.allowed or (module + ".").startswith(codec.modules):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{codec.what} may not name {module}.{name}")
