"""Exact fast paths for the Triton interpreter (``TRITON_INTERPRET=1``), where CPUs run our kernels.

XOR reductions. The interpreter reduces with numpy when it knows the combine function (sum, min, max,
argmin, argmax) and otherwise one element at a time in Python. ``tl.sort`` is a bitonic network whose
every compare-and-swap XOR-reduces over one axis to find each lane's partner, so one sort of 512 lanes
took seconds: about 85 % of the interpreted time of the top-k and indexer kernels (their compaction
sorts lane ids). The fast path gives the XOR reduction numpy's ``bitwise_xor.reduce``, the same integers.

Sorts. The network still costs its log2(n)**2 / 2 interpreted stages. Where the sorted row is unique
(integers, and floats with neither a NaN nor a -0.0, whose equal values are the same bits), ``tl.sort`` is
numpy's sort of the lanes: the same values in the same order. Other rows, and other dtypes (bf16 is
stored as its bits), run the network.

Helper calls. A launch replaces every builtin of ``triton.language`` by its interpreted form for the
launch's duration; each call of a ``@triton.jit`` helper inside it did that again, walking the modules'
members (about 1.6 ms a call, over a third of an interpreted indexer test), and found nothing left to
replace. The fast path skips the walk when every language module the helper sees is already replaced.

Overflow checks. Each integer ``+``, ``-`` and ``*`` narrower than 64 bits is also computed in int64 and
compared with its type's range, for a ``device_assert`` that acts only when the kernel's options say
``debug``, which the interpreter's never do: a quarter of an interpreted model's time went to building
checks that were then dropped. The fast path skips them unless ``debug`` is on (then the check runs).

Numpy dtypes. Every interpreted op asks which numpy dtype holds its triton type, and each answer built the
whole table of twenty types anew. The fast path keeps each scalar type's answer (a pointer's is uint64).

Nothing a device compiles changes, and where an interpreter lacks the hooks (another triton) ``install``
does nothing.
"""

from __future__ import annotations

import numpy as np
import triton.language as tl
from triton.runtime import interpreter


def install() -> bool:
    """Install the fast paths (idempotent); whether the interpreter now has them."""
    return (
        _install_xor()
        and _install_sort()
        and _install_helper_calls()
        and _install_overflow_checks()
        and _install_np_dtypes()
    )


def _install_xor() -> bool:
    ops = getattr(interpreter, "ReduceOps", None)
    xor = getattr(tl.standard, "_xor_combine", None)
    if ops is None or xor is None or not hasattr(ops, "apply_impl") or not hasattr(ops, "to_tensor"):
        return False
    if getattr(ops, "xor_in_numpy", False):
        return True
    generic = ops.apply_impl

    def apply_impl(self, input):  # noqa: ANN001, ANN202 (the interpreter's own signature)
        if self.combine_fn is not xor:
            return generic(self, input)
        x = input[0]
        reduced = np.bitwise_xor.reduce(x.handle.data, axis=self.axis, keepdims=self.keep_dims)
        return self.to_tensor(reduced, x.dtype)

    ops.apply_impl, ops.xor_in_numpy = apply_impl, True
    return True


_EXACT_FLOATS = (tl.float16, tl.float32, tl.float64)


def _install_sort() -> bool:
    network = getattr(tl.standard, "sort", None)
    if network is None or not hasattr(interpreter, "TensorHandle"):
        return False
    if getattr(network, "sorts_in_numpy", False):
        return True

    def sort(x, dim=None, descending=tl.core.CONSTEXPR_0):  # noqa: ANN001, ANN202 (tl.sort's signature)
        data, dim = x.handle.data, tl.core._unwrap_if_constexpr(dim)
        if dim not in (None, data.ndim - 1) or not _unique_when_sorted(data, x.dtype):
            return network(x, dim, descending)
        ordered = np.sort(data, axis=-1)
        if tl.core._unwrap_if_constexpr(descending):
            ordered = np.flip(ordered, -1)
        return tl.core.tensor(interpreter.TensorHandle(np.ascontiguousarray(ordered), x.handle.dtype), x.type)

    sort.sorts_in_numpy, sort.network = True, network
    tl.sort = tl.standard.sort = sort
    return True


def _unique_when_sorted(data: np.ndarray, dtype: tl.dtype) -> bool:
    if dtype.is_int() and not dtype.is_bool():
        return True
    return dtype in _EXACT_FLOATS and not np.isnan(data).any() and not (np.signbit(data) & (data == 0)).any()


def _install_helper_calls() -> bool:
    function = getattr(interpreter, "InterpretedFunction", None)
    patch = getattr(interpreter, "_patch_lang", None)
    if function is None or patch is None or not hasattr(function, "rewrite"):
        return False
    if getattr(function, "helper_calls_unpatched", False):
        return True

    def call(self, *args, **kwargs):  # noqa: ANN001, ANN202 (the interpreter's own signature)
        languages = [v for v in self.fn.__globals__.values() if v is tl or v is tl.core]
        if not languages or any(tl.core.is_builtin(language.load) for language in languages):
            patch(self.fn)  # not inside a launch that replaced them (or no language visible: its error)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    function.__call__, function.helper_calls_unpatched = call, True
    return True


def _install_overflow_checks() -> bool:
    semantic = getattr(interpreter, "interpreter_semantic", None)
    check = getattr(type(semantic), "binary_op_sanitize_overflow_impl", None)
    if check is None or not hasattr(semantic, "builder") or not hasattr(semantic, "device_assert"):
        return False
    if getattr(semantic, "overflow_checks_when_debug", False):
        return True

    def sanitize(lhs, rhs, binary_op):  # noqa: ANN001, ANN202 (the semantic's own signature)
        if semantic.builder.options.debug:  # device_assert acts: the check as triton builds it
            check(semantic, lhs, rhs, binary_op)

    # On the interpreter's own semantic only: the one a device compile builds with keeps its method.
    semantic.binary_op_sanitize_overflow_impl, semantic.overflow_checks_when_debug = sanitize, True
    return True


def _install_np_dtypes() -> bool:
    lookup = getattr(interpreter, "_get_np_dtype", None)
    if lookup is None:
        return False
    if getattr(lookup, "answers_kept", False):
        return True
    answers: dict[tl.dtype, np.dtype] = {}
    pointer = np.dtype(np.uint64)

    def np_dtype(tt_dtype):  # noqa: ANN001, ANN202 (the interpreter's own signature)
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return pointer
        if not isinstance(scalar, tl.dtype):  # not a type the table holds: the interpreter's own error
            return lookup(tt_dtype)
        found = answers.get(scalar)
        if found is None:
            found = answers[scalar] = lookup(scalar)
        return found

    np_dtype.answers_kept, np_dtype.lookup = True, lookup
    interpreter._get_np_dtype = np_dtype
    return True
