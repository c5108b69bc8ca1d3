"""Encode the user's free-form ``user_dict`` into a storable tree, and back, without pickle.

Values the storage keeps exactly (str, int, float, bool, None, bytes, tensors, lists/tuples of
one scalar type) are stored as they are. Everything else that we support is wrapped in a group
with exactly one tag key (see ``schema.USER_DICT_TAGS``): numpy arrays and scalars (loaded data
would otherwise come back as tensors), other lists and tuples (keys "0", "1", ...), ints outside
int64 (numpy ``Generator`` states hold 128-bit ints), dicts with int keys (as (key, value) pairs)
and dicts whose only key happens to be a tag. Anything else is refused unless ``allow_pickle=True``.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import CheckpointFormatError, CheckpointPickleError
from . import schema as S
from ._codec import encode_leaf
from .lazy_torch import is_tensor, torch

__all__ = ["decode_user_dict", "decode_user_value", "encode_user_dict", "encode_user_value"]

_INT64 = (-(2**63), 2**63)
_MAX_INT_DIGITS = 4000  # below Python's int-from-str limit; a longer string is not one of our values


def _pickle_error(where: str, source: str) -> CheckpointPickleError:
    return CheckpointPickleError(
        f"{source}: '{where}' holds pickled data; unpickling data from a file can execute arbitrary code. "
        "Pass allow_pickle=True only if you trust the file and who wrote it."
    )


def _storable(value: Any, where: str) -> bool:
    try:
        encode_leaf(value, where)
    except TypeError:
        return False
    return True


def _int_key(key: Any) -> bool:
    return isinstance(key, int) and not isinstance(key, bool)


def _encode(value: Any, where: str, allow_pickle: bool) -> Any:
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        encoded = {key: _encode(item, f"{where}/{key}", allow_pickle) for key, item in value.items()}
        return {S.TAG_DICT: encoded} if len(encoded) == 1 and next(iter(encoded)) in S.USER_DICT_TAGS else encoded
    if isinstance(value, Mapping) and all(isinstance(k, str) or _int_key(k) for k in value):
        pairs = [(key, item) for key, item in value.items()]
        return {S.TAG_ITEMS: _encode(pairs, where, allow_pickle)}
    if _int_key(value) and not _INT64[0] <= value < _INT64[1]:
        return {S.TAG_INT: str(value)}
    if isinstance(value, np.ndarray | np.generic) and _storable(value, where):
        return {S.TAG_NDARRAY if isinstance(value, np.ndarray) else S.TAG_NUMPY_SCALAR: np.asarray(value)}
    if isinstance(value, list | tuple) and not _storable(value, where):
        tag = S.TAG_LIST if isinstance(value, list) else S.TAG_TUPLE
        return {tag: {str(i): _encode(item, f"{where}/{i}", allow_pickle) for i, item in enumerate(value)}}
    kinds = (torch.Tensor, str, int, float, bool, bytes, list, tuple, type(None))
    if isinstance(value, kinds) and _storable(value, where):
        return value
    if allow_pickle:
        return {S.TAG_PICKLE: pickle.dumps(value)}
    if isinstance(value, Mapping):
        bad = sorted(repr(k) for k in value if not (isinstance(k, str) or _int_key(k)))
        raise TypeError(
            f"user_dict keys must be str or int, got [{', '.join(bad)}] at '{where}' (or pass allow_pickle=True)"
        )
    raise TypeError(
        f"unsupported user_dict value of type {type(value).__module__}.{type(value).__qualname__} at '{where}': "
        "supported are str, int, float, bool, None, bytes, lists, tuples, dicts with str or int keys, numpy "
        "arrays and torch tensors (pass allow_pickle=True to pickle it, only if readers trust the file)"
    )


def encode_user_value(value: Any, where: str, *, allow_pickle: bool = False) -> Any:
    """Like `encode_user_dict` for any one value (not only a mapping); ``where`` names it in errors."""
    return _encode(value, where, allow_pickle)


def decode_user_value(node: Any, where: str, *, allow_pickle: bool = False, source: str = "checkpoint") -> Any:
    """Restore a value written by `encode_user_value`."""
    return _decode(node, where, source, allow_pickle)


def encode_user_dict(user_dict: Mapping[str, Any], *, allow_pickle: bool = False) -> dict[str, Any]:
    """Turn ``user_dict`` into a tree that ``save`` stores and ``decode_user_dict`` restores exactly.

    Raises TypeError naming the key path (``user_dict/...``) for values it cannot store without
    pickle; with ``allow_pickle=True`` those values are pickled under a ``__pickle__`` tag instead.
    """
    if not isinstance(user_dict, Mapping):
        raise TypeError(f"user_dict must be a Mapping, got {type(user_dict).__name__}")
    return _encode(user_dict, S.USER_DICT_KEY, allow_pickle)


def _decode_sequence(node: Any, where: str, source: str, allow_pickle: bool) -> list[Any]:
    if not isinstance(node, Mapping) or sorted(node, key=_index) != [str(i) for i in range(len(node))]:
        raise CheckpointFormatError(f"{source}: malformed list at '{where}': expected keys '0'..'{len(node) - 1}'")
    return [_decode(node[str(i)], f"{where}/{i}", source, allow_pickle) for i in range(len(node))]


def _index(key: str) -> int:
    return int(key) if key.isdigit() else -1


def _as_numpy(value: Any, where: str, source: str) -> np.ndarray:
    if is_tensor(value):
        return value.numpy()
    if isinstance(value, np.ndarray | np.generic):
        return np.asarray(value)
    raise CheckpointFormatError(f"{source}: expected array data at '{where}', got {type(value).__name__}")


def _decode_tagged(tag: str, value: Any, where: str, source: str, allow_pickle: bool) -> Any:
    if tag == S.TAG_NDARRAY:
        return _as_numpy(value, where, source)
    if tag == S.TAG_NUMPY_SCALAR:
        return _as_numpy(value, where, source)[()]
    if tag in (S.TAG_LIST, S.TAG_TUPLE):
        items = _decode_sequence(value, where, source, allow_pickle)
        return items if tag == S.TAG_LIST else tuple(items)
    if tag == S.TAG_INT:
        return _decode_int(value, where, source)
    if tag == S.TAG_ITEMS:
        pairs = _decode(value, where, source, allow_pickle)
        if not isinstance(pairs, list) or not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
            raise CheckpointFormatError(f"{source}: malformed int-keyed dict at '{where}': expected (key, value) pairs")
        return dict(pairs)
    if tag == S.TAG_DICT:
        if not isinstance(value, Mapping):
            raise CheckpointFormatError(f"{source}: malformed dict at '{where}'")
        return {key: _decode(item, f"{where}/{key}", source, allow_pickle) for key, item in value.items()}
    if not allow_pickle:
        raise _pickle_error(where, source)
    if not isinstance(value, bytes):
        raise CheckpointFormatError(f"{source}: malformed pickle at '{where}': expected bytes")
    return pickle.loads(value)  # noqa: S301 - reached only with allow_pickle=True: the caller trusts the file


def _decode_int(value: Any, where: str, source: str) -> int:
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    digits = text[1:] if isinstance(text, str) and text.startswith("-") else text
    if not isinstance(text, str) or not digits.isdigit() or not digits.isascii() or len(digits) > _MAX_INT_DIGITS:
        raise CheckpointFormatError(f"{source}: malformed big int at '{where}': expected a decimal string")
    return int(text)


def _decode(node: Any, where: str, source: str, allow_pickle: bool) -> Any:
    if isinstance(node, Mapping):
        if len(node) == 1 and next(iter(node)) in S.USER_DICT_TAGS:
            tag = next(iter(node))
            return _decode_tagged(tag, node[tag], where, source, allow_pickle)
        return {key: _decode(item, f"{where}/{key}", source, allow_pickle) for key, item in node.items()}
    return node


def _decode_legacy_hex(data: str | bytes, source: str, allow_pickle: bool) -> Any:
    """Legacy ORTTrainer: ``pickle.dumps(user_dict).hex()`` stored as an ASCII string."""
    if not allow_pickle:
        raise _pickle_error(S.USER_DICT_KEY, source)
    try:
        raw = bytes.fromhex(data.decode("ascii") if isinstance(data, bytes) else data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointFormatError(f"{source}: legacy user_dict is not a hex string ({exc})") from None
    return pickle.loads(raw)  # noqa: S301 - reached only with allow_pickle=True: the caller trusts the file


def decode_user_dict(tree_or_legacy: Any, *, allow_pickle: bool = False, source: str = "checkpoint") -> Any:
    """Restore a user_dict from what ``load`` returned for the ``user_dict`` key.

    Accepts our encoded tree, or a legacy ORTTrainer hex string (a pickle: refused with
    CheckpointPickleError unless ``allow_pickle=True``). ``source`` (the file) is named in errors.
    """
    if isinstance(tree_or_legacy, str | bytes):
        return _decode_legacy_hex(tree_or_legacy, source, allow_pickle)
    if not isinstance(tree_or_legacy, Mapping):
        raise CheckpointFormatError(
            f"{source}: user_dict must be a group or a legacy hex string, got {type(tree_or_legacy).__name__}"
        )
    return _decode(tree_or_legacy, S.USER_DICT_KEY, source, allow_pickle)
