"""Validation machinery behind ``ORTTrainerOptions``: errors, per-field checks, dict <-> dataclass.

Every option section is a frozen dataclass with a class-level ``_PATH`` (its dotted location in
the legacy nested dict). Its ``__post_init__`` runs a ``Checker`` that validates and normalises
each field (lists become tuples, dicts are copied) and raises one error listing every problem.
``build_section`` turns a legacy dict into a section, rejecting unknown keys and collecting the
problems of nested sections so the user sees all of them at once.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple, TypeVar

__all__ = ["Checker", "OptionTypeError", "OptionsError", "build_section", "join_path", "section_to_dict"]

_T = TypeVar("_T")


class Problem(NamedTuple):
    """One invalid option: its dotted path, what is wrong, and whether it is a type problem."""

    path: str
    message: str
    is_type: bool


class OptionsError(ValueError):
    """Invalid ``ORTTrainerOptions``; ``problems`` holds every offending option (sorted by path)."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems = tuple(sorted(problems))
        lines = "\n".join(f"  - {p.path or '<options>'}: {p.message}" for p in self.problems)
        super().__init__(f"Invalid options ({len(self.problems)} problem(s)):\n{lines}")

    @staticmethod
    def of(problems: list[Problem]) -> OptionsError:
        """``OptionTypeError`` when every problem is a wrong type, else ``OptionsError``."""
        return OptionTypeError(problems) if all(p.is_type for p in problems) else OptionsError(problems)


class OptionTypeError(OptionsError, TypeError):
    """An option has the wrong type (also a ValueError, like every legacy options error)."""


def join_path(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _got(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


class Checker:
    """Validate and normalise the fields of one frozen section; ``done()`` raises all problems at once."""

    def __init__(self, section: Any) -> None:
        self.section = section
        self.path: str = type(section)._PATH
        self.problems: list[Problem] = []

    # -- bookkeeping -------------------------------------------------------------------------
    def fail(self, name: str, message: str, *, is_type: bool = False) -> None:
        self.problems.append(Problem(join_path(self.path, name), message, is_type))

    def _wrong_type(self, name: str, expected: str, value: Any) -> None:
        self.fail(name, f"expected {expected}, got {_got(value)}", is_type=True)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self.section, name, value)

    def ok(self, *names: str) -> bool:
        """True when none of ``names`` has a problem yet (guards cross-field checks)."""
        bad = {p.path for p in self.problems}
        return not any(join_path(self.path, n) in bad for n in names)

    def done(self) -> None:
        if self.problems:
            raise OptionsError.of(self.problems)

    # -- field checks ------------------------------------------------------------------------
    def boolean(self, name: str) -> None:
        value = getattr(self.section, name)
        if not isinstance(value, bool):
            self._wrong_type(name, "bool", value)

    def integer(self, name: str, lo: int | None = None, hi: int | None = None) -> None:
        value = getattr(self.section, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            self._wrong_type(name, "int", value)
        elif (lo is not None and value < lo) or (hi is not None and value > hi):
            bounds = f"between {lo} and {hi}" if lo is not None and hi is not None else f">= {lo}"
            self.fail(name, f"expected int {bounds}, got {value}")
        else:
            self._set(name, int(value))

    def string(self, name: str) -> None:
        value = getattr(self.section, name)
        if not isinstance(value, str):
            self._wrong_type(name, "str", value)

    def string_list(self, name: str) -> None:
        """A list/tuple of str, stored as a tuple (so the frozen section cannot be mutated through it)."""
        value = getattr(self.section, name)
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            self._wrong_type(name, "list of str", value)
        else:
            self._set(name, tuple(value))

    def string_dict(self, name: str, convert: Callable[[Any], Any], expected: str) -> None:
        """A dict with str keys whose values ``convert`` accepts (it raises TypeError/ValueError otherwise)."""
        value = getattr(self.section, name)
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            self._wrong_type(name, expected, value)
            return
        try:
            self._set(name, {k: convert(v) for k, v in value.items()})
        except (TypeError, ValueError):
            self._wrong_type(name, expected, value)

    def instance(self, name: str, cls: type | tuple[type, ...], expected: str, *, optional: bool = True) -> None:
        value = getattr(self.section, name)
        if not ((optional and value is None) or isinstance(value, cls)):
            self._wrong_type(name, expected + (" or None" if optional else ""), value)

    def callable_or_none(self, name: str) -> None:
        value = getattr(self.section, name)
        if value is not None and not callable(value):
            self._wrong_type(name, "a callable or None", value)


# ---------------------------------------------------------------------------------------------
# legacy dict <-> section


def _nested_sections(cls: type) -> dict[str, type]:
    """Fields whose default is another section: ``{field name: section class}``."""
    return {
        f.name: f.default_factory
        for f in dataclasses.fields(cls)
        if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory)
    }


def build_section(cls: type[_T], value: Any, path: str) -> _T:
    """Build section ``cls`` from a legacy (nested) dict or an instance, reporting every problem at once.

    ``value`` is only read, never mutated; the section copies what it keeps.
    """
    if isinstance(value, cls):
        value = section_to_dict(value)
    if not isinstance(value, Mapping):
        where = path or "options"
        raise OptionTypeError([Problem(path, f"expected a dict for {where!r}, got {_got(value)}", True)])
    valid = [f.name for f in dataclasses.fields(cls)]
    problems = [
        Problem(
            join_path(path, str(key)),
            f"unknown option; valid keys {'under ' + repr(path) if path else 'at the top level'}: {', '.join(valid)}",
            False,
        )
        for key in value
        if key not in valid
    ]
    nested = _nested_sections(cls)
    kwargs: dict[str, Any] = {}
    for name in valid:
        if name not in value:
            continue
        if name in nested:
            try:
                kwargs[name] = build_section(nested[name], value[name], join_path(path, name))
            except OptionsError as error:
                problems.extend(error.problems)
        else:
            kwargs[name] = value[name]
    try:
        section = cls(**kwargs)
    except OptionsError as error:
        problems.extend(error.problems)
    if problems:
        raise OptionsError.of(problems)
    return section


def _plain(value: Any) -> Any:
    """Tuples/lists -> lists and dicts -> dicts, recursively; anything else (objects) by reference."""
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def section_to_dict(section: Any) -> dict[str, Any]:
    """The legacy nested dict of ``section``: plain data is copied, objects are kept by reference."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        out[f.name] = section_to_dict(value) if dataclasses.is_dataclass(value) else _plain(value)
    return out
